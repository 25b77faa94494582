"""MLA attention in absorbed form: the backend protocol (base), the registry, the shared paged backend.

Knows nothing of EAGLE beyond the forward modes."""
