"""ConfigError and the helpers the sections' checks share.

    .venv/bin/python -m pytest tests/unit/test_config.py tests/unit/test_bad_inputs.py

Every check raises a one-line `ConfigError` naming the dotted field, the value and the fix.
"""


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the field and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(`message`) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def first_change(value: object, default: object, dotted: str) -> tuple[str, object] | None:
    """(dotted name, value) of the first field where `value` differs from `default`."""
    if value == default:
        return None
    if not hasattr(value, "__dataclass_fields__"):
        return dotted, value
    for name in value.__dataclass_fields__:
        changed = first_change(getattr(value, name), getattr(default, name), f"{dotted}.{name}")
        if changed is not None:
            return changed
    return None
