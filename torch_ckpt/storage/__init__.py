"""Where bytes live: local directories and fsspec stores behind one Location interface, bounded reads, CRC-32,
store-call deadlines. Internal to the packages above; nothing public here."""

__all__: list[str] = []
