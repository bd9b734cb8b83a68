"""ConfigError and the helpers the sections' checks share.

    .venv/bin/python -m pytest tests/unit/test_config.py tests/unit/test_bad_inputs.py

Every check raises a one-line `ConfigError` naming the dotted field, the value and the fix.
"""

import json
from pathlib import Path


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


def read_json(folder: str | Path, name: str, field: str) -> dict:
    """The JSON object in the file `name` of `folder`, the folder config field `field` names
    (e.g. model.hf_checkpoint); a missing, unreadable or damaged file is a ConfigError naming
    the field, the folder and the file."""
    where = f"{field} = {str(folder)!r}"
    try:
        value = json.loads((Path(folder) / name).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{where} has no {name}") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {name} ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where}: {name} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno}; "
            "cut short or damaged?): download it again"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: {name} is not UTF-8 text ({e.reason} at byte {e.start}): download it again"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where}: {name} holds a JSON {type(value).__name__}, not an object: download it again"
        )
    return value


def text_fields(config: dict) -> dict:
    """A config.json's text model's fields: a vision-language model's `text_config` (Muse
    Glimmer's: vocab_size, layers, heads are there), else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config
