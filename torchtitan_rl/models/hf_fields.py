"""An HF checkpoint's config.json values, read for `model.flavor = "auto"` (from_hf.py): a
field is required, checked against what the family's torchtitan model can express, or read with
a default, and every refusal is one ConfigError line naming the field and its value.

    .venv/bin/python -m pytest tests/unit/test_from_hf.py
"""

import dataclasses
import json

from torchtitan_rl.config.errors import ConfigError


class Fields:
    """config.json's values, read with the checks that keep a field from being dropped."""

    def __init__(self, config: dict, folder: str, prefix: str = ""):
        self.config, self.folder, self.prefix = config, folder, prefix

    def section(self, key: str) -> "Fields":
        """The fields of a nested table (`text_config`), named `key.field` in errors."""
        return Fields(self.need(key), self.folder, f"{self.prefix}{key}.")

    def fail(self, key: str, value, why: str) -> ConfigError:
        return ConfigError(
            f"model.hf_checkpoint = {self.folder!r}: config.json's {self.prefix}{key} = "
            f"{json.dumps(value)} {why}: name a flavor, or convert the checkpoint"
        )

    def get(self, key: str, default=None):
        value = self.config.get(key)
        return default if value is None else value

    def need(self, key: str):
        if self.config.get(key) is None:
            raise ConfigError(
                f"model.hf_checkpoint = {self.folder!r}: config.json has no {self.prefix}{key}, "
                "which model.flavor = 'auto' reads the model's shape from: name a flavor"
            )
        return self.config[key]

    def expect(self, key: str, allowed: tuple, why: str) -> None:
        """`key` is absent or one of `allowed`, else one line saying `why` not."""
        value = self.config.get(key)
        if value is not None and value not in allowed:
            raise self.fail(key, value, why)

    def head_dim(self) -> int:
        return self.get("head_dim", self.need("hidden_size") // self.need("num_attention_heads"))

    def rope(self) -> dict:
        """RoPE's parameters: transformers 5's `rope_parameters`, or the older `rope_theta`
        and `rope_scaling`; `rope_type` "default" when neither names one."""
        scaling = self.get("rope_scaling", {})
        params = {**scaling, **self.get("rope_parameters", {})}
        params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        return params


def set_norm_eps(config, eps: float) -> None:
    """Every RMSNorm config in `config`'s tree gets `eps` (the layer builders fix their own)."""
    from torchtitan.models.common import RMSNorm

    if isinstance(config, RMSNorm.Config):
        config.eps = eps
    elif isinstance(config, list):
        for item in config:
            set_norm_eps(item, eps)
    elif dataclasses.is_dataclass(config):
        for field in dataclasses.fields(config):
            set_norm_eps(getattr(config, field.name), eps)
