"""A foundation setting as the benches name it: "default", or one FoundationConfig field as name=value
(bench/foundation_ab.py, bench/foundation_seeds.py, bench/panel.py --foundation)."""


def settings(variant: str) -> dict:
    """'default' -> {}; 'name=value' -> that FoundationConfig field, typed as its default."""
    from habitus.models.train.config import FoundationConfig

    if variant == "default":
        return {}
    name, _, value = variant.partition("=")
    if name not in FoundationConfig.__dataclass_fields__ or not value:
        raise ValueError(f"{variant!r}: expected 'default' or name=value with a FoundationConfig field, one of "
                         f"{', '.join(FoundationConfig.__dataclass_fields__)}")
    kind = type(getattr(FoundationConfig(), name))
    return {name: value.lower() in ("1", "true") if kind is bool else kind(value)}
