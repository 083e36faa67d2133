"""The workspace on disk and the `output:` store: uploads, restores, manifests, free space."""
