"""Typed configuration: dataclass schemas, validation, derived values."""
