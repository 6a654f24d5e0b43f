"""ggufswap.config."""

__all__: list[str] = []
