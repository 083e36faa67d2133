"""The filesystem an `output:` URL names (`open_store`): pyarrow's for an object store, a `FolderStore` for
a folder.

A folder as `output:` (a local or a mounted folder: NFS, SMB, a SageMaker channel), with the methods of a
pyarrow FileSystem that resources/store/output.py uses, and no operation that passes through a symbolic link.

Whoever can write to a shared folder can plant a link in it (`checkpoints/scenarios/churn` -> a user's
`~/.ssh`): keys are checked as text (resources/store/manifests.py), and the folder's own entries are checked here,
at use: every folder below the store's root is opened with O_NOFOLLOW | O_DIRECTORY, one component at a
time from the root's descriptor, and every file is created, opened, renamed, examined or deleted relative to
its folder's descriptor, never by its path. A link met anywhere below the root (a folder on the way, or
the entry itself) stops the operation with an OutputError naming the entry; a file that is not a regular
file (a FIFO, a device) is never opened for reading. A file is written under a new name only (an existing
entry is unlinked first, O_EXCL), so a hard link planted at a key is never written through either.

The root is the configured folder resolved once (links in the configured path itself are the user's own
layout, e.g. /mnt/models -> /data/models); it is opened without following a link at every operation, so
a root swapped for a link afterwards is refused too. Object stores have no links and keep pyarrow's own
filesystems: the code of resources/store/output.py is the same for both."""

import contextlib
import errno
import os
import re
import stat
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from habitus.resources.store.manifests import OutputError, has_user_info
from habitus.resources.store.redaction import redact_text, redact_url, url_secrets

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks the open
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FolderStore:
    """The folder `base` (the output's path as configured; keys are `base/rel`) as a pyarrow-like filesystem:
    get_file_info, create_dir, open_output_stream, open_input_stream / open_input_file, delete_file, move."""

    def __init__(self, base: str):
        self.base = base.rstrip("/") or "/"
        self.root = os.path.realpath(self.base)

    # ------------------------------------------------------------------ walking without links

    def _parts(self, key: str) -> list[str]:
        """The components of `key` below the root; OutputError for a key outside the folder or with an empty,
        `.` or `..` component (keys are checked before they get here: this is the last guard)."""
        head = self.base.rstrip("/")
        if key.rstrip("/") == head:
            return []
        if not key.startswith(head + "/"):
            raise OutputError(f"output {self.base}: {key!r} is not a key under the output folder")
        rest = key[len(head) + 1:]
        parts = (rest.lstrip("/") if not head else rest).split("/")  # the folder "/" has keys "//x"
        if any(p in ("", ".", "..") for p in parts):
            raise OutputError(f"output {self.base}: {key!r} is not a plain key under the output folder")
        return parts

    def _shown(self, parts: list[str]) -> str:
        return "/".join([self.base.rstrip("/"), *parts]) if parts else self.base

    def _link(self, parts: list[str]) -> OutputError:
        return OutputError(f"output {self.base}: {self._shown(parts)} is a symbolic link; nothing in an output folder "
                           f"is read, written or deleted through a link (whoever can write there could point it "
                           f"anywhere). Remove the link, check who can write to that folder, and run again")

    @contextlib.contextmanager
    def _folder(self, parts: list[str], create: bool = False):
        """A descriptor of the folder `parts` below the root, each component opened without following a
        link (`create`: missing folders are made); OutputError naming the first link on the way."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        try:
            fd = os.open(self.root, _FOLDER)
        except OSError as e:  # Linux says ENOTDIR for O_DIRECTORY | O_NOFOLLOW on a link, others ELOOP
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and os.path.islink(self.root):
                raise self._link([]) from None
            raise
        try:
            for i, name in enumerate(parts):
                try:
                    nxt = os.open(name, _FOLDER, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, dir_fd=fd)
                    nxt = self._open_folder(name, fd, parts[:i + 1])
                except OSError as e:
                    self._refuse_link(name, fd, parts[:i + 1], e)
                    raise
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def _open_folder(self, name: str, fd: int, parts: list[str]) -> int:
        try:
            return os.open(name, _FOLDER, dir_fd=fd)
        except OSError as e:
            self._refuse_link(name, fd, parts, e)
            raise

    def _refuse_link(self, name: str, fd: int, parts: list[str], error: OSError) -> None:
        """Raise the link error when `error` (of an open without following) came from a link at `name`."""
        if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            st = self._lstat(name, fd)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise self._link(parts) from None

    @staticmethod
    def _lstat(name: str, fd: int) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def _entry(self, key: str, create: bool = False):
        """(folder descriptor, name, parts, lstat or None) of the entry `key`; a link there is refused."""
        parts = self._parts(key)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the output folder itself is not a file", key)
        with self._folder(parts[:-1], create=create) as fd:
            st = self._lstat(parts[-1], fd)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise self._link(parts)
            yield fd, parts[-1], parts, st

    # ------------------------------------------------------------------ the pyarrow FileSystem methods used

    def get_file_info(self, what):
        """FileInfo of a key (a link anywhere on its path: OutputError), or of every entry under a
        FileSelector's folder, where a link is listed as FileType.Unknown and never entered."""
        from pyarrow.fs import FileInfo, FileSelector, FileType

        if isinstance(what, FileSelector):
            return self._listing(what)
        parts = self._parts(what)
        try:
            with self._folder(parts[:-1]) as fd:
                st = os.fstat(fd) if not parts else self._lstat(parts[-1], fd)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None:
            return FileInfo(what, FileType.NotFound)
        if stat.S_ISLNK(st.st_mode):
            raise self._link(parts)
        return _info(what, st)

    def _listing(self, selector) -> list:
        parts = self._parts(selector.base_dir)
        found = []
        try:
            with self._folder(parts) as fd:
                self._list(fd, selector.base_dir.rstrip("/"), selector.recursive, found)
        except (FileNotFoundError, NotADirectoryError):
            if not selector.allow_not_found:
                raise
        return found

    def _list(self, fd: int, prefix: str, recursive: bool, found: list) -> None:
        for name in sorted(os.listdir(fd)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            found.append(_info(f"{prefix}/{name}", st))
            if recursive and stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _FOLDER, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):  # swapped meanwhile: not entered
                        continue
                    raise
                try:
                    self._list(sub, f"{prefix}/{name}", recursive, found)
                finally:
                    os.close(sub)

    def create_dir(self, key: str, recursive: bool = True) -> None:
        with self._folder(self._parts(key), create=True):
            pass

    def open_output_stream(self, key: str):
        """A new file at `key` (its folders made; an entry already there unlinked, never written into)."""
        with self._entry(key, create=True) as (fd, name, parts, st):
            if st is not None:
                os.unlink(name, dir_fd=fd)
            try:
                return os.fdopen(os.open(name, _WRITE, 0o666, dir_fd=fd), "wb")
            except OSError as e:
                self._refuse_link(name, fd, parts, e)
                raise

    def open_input_stream(self, key: str):
        """The regular file at `key`, opened without following a link; seekable (`open_input_file`)."""
        with self._entry(key) as (fd, name, parts, _):
            try:
                f = os.open(name, _READ, dir_fd=fd)
            except OSError as e:
                self._refuse_link(name, fd, parts, e)
                raise
            if not stat.S_ISREG(os.fstat(f).st_mode):
                os.close(f)
                raise OutputError(f"output {self.base}: {self._shown(parts)} is not a regular file (a FIFO, a device "
                                  f"or a folder); nothing is read from it. Check who can write to that folder")
            os.set_blocking(f, True)
            return os.fdopen(f, "rb")

    open_input_file = open_input_stream

    def delete_file(self, key: str) -> None:
        with self._entry(key) as (fd, name, parts, st):
            if st is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", key)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a folder, not a file", key)
            os.unlink(name, dir_fd=fd)

    def move(self, src: str, dst: str) -> None:
        """Rename the regular file `src` onto `dst` as a commit: fsync(file) -> rename -> fsync(folder)
        (models/storage/files.py durable_replace), every folder on both paths opened without a link."""
        with self._entry(src) as (sfd, sname, sparts, st), self._entry(dst, create=True) as (dfd, dname, dparts, dst_st):
            if st is None or not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(errno.ENOENT, "no such file", src)
            if dst_st is not None and stat.S_ISDIR(dst_st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "a folder is in the way", dst)
            f = os.open(sname, _READ, dir_fd=sfd)
            try:
                os.fsync(f)
            finally:
                os.close(f)
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            os.fsync(dfd)


def _info(path: str, st: os.stat_result):
    from pyarrow.fs import FileInfo, FileType

    if stat.S_ISREG(st.st_mode):
        return FileInfo(path, FileType.File, size=st.st_size, mtime_ns=st.st_mtime_ns)
    if stat.S_ISDIR(st.st_mode):
        return FileInfo(path, FileType.Directory, mtime_ns=st.st_mtime_ns)
    return FileInfo(path, FileType.Unknown)  # a link, a FIFO, a device: never followed, read or listed as a file


def open_regular(path: Path):
    """The regular file `path` of the workspace, opened for reading without following a link at its last
    component (resources/store/manifests.py `inside` checks the folders above it); OutputError naming it otherwise."""
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise OutputError(f"{path} is a symbolic link; nothing is read or written through a link in the workspace "
                              f"(remove it, or use a workspace without links)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputError(f"{path} is not a regular file (a FIFO, a device or a folder); it is not uploaded")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def open_store(url: str):
    """(pyarrow FileSystem, base path without a trailing '/') for an output URL or folder."""
    from pyarrow import fs as pafs

    if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url) or url.startswith("file://"):
        path = url.removeprefix("file://")
        if not os.path.isabs(path):
            raise OutputError(f"output {redact_url(url)!r}: a folder must be an absolute path (the project loader resolves "
                              f"relative ones against the config file)")
        store = FolderStore(path)  # no operation passes through a link
        return store, store.base
    if has_user_info(url):  # checked on the text: urlsplit raises on a password holding / or ?, quoting it
        raise OutputError(f"output {redact_url(url)!r}: credentials in the URL are not read (and would be logged); "
                          f"give them as the store's variables (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)")
    parts = urlsplit(url)
    if parts.scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise OutputError(f"output {redact_url(url)!r}: name a bucket, s3://bucket/prefix/")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint = query.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL_S3") or \
            os.environ.get("AWS_ENDPOINT_URL")
        region = query.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region is None and not endpoint:  # AWS itself: the bucket's own region (one request)
            try:
                region = pafs.resolve_s3_region(parts.netloc)
            except (OSError, ValueError):
                region = None
        kw = {"region": region or "us-east-1", "connect_timeout": 10, "request_timeout": 60,
              "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
        if endpoint:
            scheme, _, host = endpoint.rpartition("://")
            kw.update(endpoint_override=host.rstrip("/"), scheme=query.get("scheme") or scheme or "https")
        return pafs.S3FileSystem(**kw), f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    try:
        filesystem, path = pafs.FileSystem.from_uri(url)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise OutputError(f"output {redact_url(url)!r}: pyarrow cannot open it ({redact_text(e, url_secrets(url))}); use s3://, gs://, abfs:// or a folder") from None
    return filesystem, path.rstrip("/")
