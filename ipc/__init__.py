"""ggufswap.ipc."""

__all__: list[str] = []
