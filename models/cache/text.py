"""Text columns (`type: text`: a product name, a description): each distinct text is a value of the
column's vocabulary, as a categorical column's, and also a vector of TEXT_WIDTH floats.

The encoder is fitted on the data, offline, with nothing downloaded: the lower-cased text's words and
their character 2- to 4-grams (words padded with spaces) are hashed (CRC32, the same on every
machine and run) into BUCKETS counts, weighted by log(1 + count) x IDF and normalized, then reduced by
a truncated SVD (randomized, seeded: deterministic) fitted on the column's FIT_VALUES most frequent
values when the cache is first built. It is saved with the vocabulary (`vocab/<column>.text.npz`)
and carried, unchanged, by every later version of the cache (append or rebuild with the same
settings), so a text has the same vector on every run, and a text never seen when it was fitted (a
new product's name) still gets one: its n-grams are hashed the same way.
"""

import functools
import shutil
import zlib
from pathlib import Path

import numpy as np

TEXT_WIDTH = 32  # floats per text
BUCKETS = 1 << 15  # hashed n-gram counts
NGRAMS = (2, 3, 4)  # character n-grams of each word, padded with spaces
FIT_VALUES = 100_000  # distinct texts the SVD is fitted on (the most frequent: ids are by count)
OVERSAMPLE, POWER = 10, 4  # randomized SVD


def _grams(text: str) -> list[str]:
    out = []
    for word in str(text).lower().split():
        out.append(f"w:{word}")
        padded = f" {word} "
        out += [padded[i:i + n] for n in NGRAMS for i in range(len(padded) - n + 1)]
    return out


def hashed(texts) -> "scipy.sparse.csr_matrix":  # noqa: F821
    """[texts, BUCKETS] log(1 + count) of each text's hashed n-grams."""
    import scipy.sparse as sp

    rows, cols = [], []
    for r, text in enumerate(texts):
        grams = _grams(text) if text is not None else []
        cols += [zlib.crc32(g.encode()) % BUCKETS for g in grams]
        rows += [r] * len(grams)
    m = sp.csr_matrix((np.ones(len(cols), np.float32), (rows, cols)), shape=(len(texts), BUCKETS))
    m.sum_duplicates()
    m.data = np.log1p(m.data)
    return m


def _weighted(m, idf: np.ndarray):
    m = m.multiply(idf[None, :]).tocsr()
    norms = np.sqrt(np.asarray(m.multiply(m).sum(1)).ravel())
    return m.multiply(1.0 / np.maximum(norms, 1e-12)[:, None]).tocsr()


def fit_encoder(texts, width: int = TEXT_WIDTH) -> dict:
    """{"idf": [BUCKETS], "components": [width, BUCKETS]} fitted on `texts` (deterministic)."""
    m = hashed(texts)
    df = np.bincount(m.indices, minlength=BUCKETS)
    idf = (np.log((1 + m.shape[0]) / (1 + df)) + 1).astype(np.float32)
    x = _weighted(m, idf)
    rng = np.random.default_rng(0)
    k = min(width + OVERSAMPLE, *x.shape)
    q = np.linalg.qr(x.T @ rng.standard_normal((x.shape[0], k)).astype(np.float32))[0]  # [BUCKETS, k]
    for _ in range(POWER):
        q = np.linalg.qr(x.T @ (x @ q))[0]
    _, _, vt = np.linalg.svd(np.asarray(x @ q), full_matrices=False)
    components = (vt @ q.T)[:width]  # [width, BUCKETS]
    signs = np.sign(components[np.arange(len(components)), np.abs(components).argmax(1)])
    components = components * signs[:, None]  # (each component's sign fixed: the same on every run)
    if len(components) < width:  # fewer texts than the width: the rest of the vector stays zero
        components = np.vstack([components, np.zeros((width - len(components), BUCKETS))])
    return {"idf": idf, "components": components.astype(np.float32)}


def transform(encoder: dict, texts) -> np.ndarray:
    """[texts, width] float32: each text's vector (zeros for a null or empty text)."""
    return np.asarray(_weighted(hashed(texts), encoder["idf"]) @ encoder["components"].T, np.float32)


def encoder_path(cache_path: Path, column: str) -> Path:
    return Path(cache_path) / "vocab" / f"{column}.text.npz"


def write_encoder(out: Path, column: str, texts, seed_path: Path | None) -> int:
    """The column's encoder in the cache being built at `out`: the previous version's (`seed_path`, a
    cache folder) where it has one, else fitted on `texts` (the vocabulary's values, most frequent
    first). Returns the vector width."""
    target = encoder_path(out, column)
    if seed_path is not None and encoder_path(seed_path, column).exists():
        shutil.copyfile(encoder_path(seed_path, column), target)
    else:
        np.savez(target, **fit_encoder(list(texts)[:FIT_VALUES]))
    return TEXT_WIDTH


@functools.lru_cache(maxsize=8)
def _encoder(path: str) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def text_vectors(cache, column: str, ids: np.ndarray) -> np.ndarray:
    """[len(ids), width] the vectors of the vocabulary ids `ids` of text column `column` (id 0: zeros)."""
    ids = np.asarray(ids, np.int64)
    values = cache.vocab(column).column("value").to_numpy(zero_copy_only=False)
    texts = [values[i - 1] if i > 0 else None for i in ids]
    return transform(_encoder(str(encoder_path(cache.path, column))), texts)
