"""ggufswap.agent."""

__all__: list[str] = []
