"""The attention backends: one class per kernel family, each a PagedMLABackend overriding only its kernel call."""
