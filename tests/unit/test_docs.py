"""The README and docs/ say what the code is: every run config they name exists and passes
what `--job.dry_run` checks, and docs/configuration.md lists the schema's sections.

    .venv/bin/python -m pytest tests/unit/test_docs.py
"""

import dataclasses
import re
import tomllib

import pytest
from helpers.launch import REPO, TINY

from torchtitan_rl.config import JobConfig, parse_args
from torchtitan_rl.sft import SFT
from torchtitan_rl.train import RL

VL = str(REPO / "assets" / "tiny_vl_muse_glimmer")
pytestmark = pytest.mark.usefixtures("repo_cwd")

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The GPU recipes and the world each is checked in (its GPUs).
GPU_RECIPES = {
    "run_configs/qwen3_0.6b.toml": 8,
    "run_configs/qwen3_1.7b.toml": 8,
    "run_configs/qwen3_8b.toml": 8,
    "run_configs/qwen3_32b.toml": 8,
    "run_configs/qwen3_30b_a3b.toml": 8,
    "run_configs/gpt_oss_20b.toml": 8,
    "run_configs/deepseek_v3_671b.toml": 256,
    "run_configs/moonlight_16b_a3b.toml": 8,
    "run_configs/muse_glimmer_30b.toml": 8,
    "run_configs/muse_glimmer_30b_mm.toml": 8,
    "run_configs/qwen3_5_9b.toml": 8,
    "run_configs/qwen3_5_35b_a3b.toml": 8,
}


def named_configs() -> set[str]:
    return {
        name
        for page in PAGES
        for name in re.findall(r"run_configs/[A-Za-z0-9_.]+\.toml", page.read_text())
    }


def test_docs_exist_and_every_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md")
    assert len(pages) >= 10
    assert [p for p in pages if f"(docs/{p}" not in readme] == []


def test_every_named_run_config_exists_and_every_shipped_one_is_named():
    names = named_configs()
    assert {"run_configs/debug_cpu.toml", "run_configs/sft_arith_cpu.toml"} <= names
    assert [n for n in sorted(names) if not (REPO / n).is_file()] == []
    # And every config is named, so that each passes the checks below.
    shipped = {f"run_configs/{p.name}" for p in (REPO / "run_configs").glob("*.toml")}
    assert sorted(shipped - names) == []


# One test per config: the slow ones (a tokenizer read, a task's rows rendered) spread over the
# workers.
@pytest.mark.parametrize("name", sorted(named_configs()))
def test_a_named_run_config_passes_the_dry_run_checks(name, tmp_path):
    if name in GPU_RECIPES:
        # The GPU recipes point at a checkpoint and GSM8K files the user provides: stand them
        # in.
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "train.parquet").write_bytes(b"")
        data = str(tmp_path / "train.parquet")
        flags = ["--model.hf_checkpoint", str(tmp_path), "--task.dataset_path", data]
        parse_args(
            ["--job.config_file", name, *flags, "--eval.dataset_path", data], GPU_RECIPES[name]
        )
        return
    # What `python -m torchtitan_rl.{train,sft} --job.config_file NAME --job.dry_run` checks,
    # under the demo's torchrun world of 2: the config, then the task's data. A config that
    # starts from the SFT stage's export (outputs/...) gets the tiny checkpoint the SFT stage
    # starts from.
    program = SFT if name.startswith("run_configs/sft_") else RL
    flags = ["--job.config_file", name]
    toml = tomllib.loads((REPO / name).read_text())
    if toml["model"]["hf_checkpoint"].startswith("outputs/"):
        stand_in = VL if toml["model"].get("flavor") == "tiny_vl" else TINY
        flags += ["--model.hf_checkpoint", stand_in]
    # So does a distill teacher that an earlier stage exports.
    if toml.get("distill", {}).get("teacher_checkpoint", "").startswith("outputs/"):
        flags += ["--distill.teacher_checkpoint", TINY]
    program.open(parse_args(flags, 2, entry=program.entry))


def documented_sections() -> tuple[set[str], set[str]]:
    """The bullets of docs/configuration.md's "Sections", and its top-level fields."""
    text = (REPO / "docs" / "configuration.md").read_text()
    part = text.split("## Sections", 1)[1].split("\n## ", 1)[0]
    sections = set(re.findall(r"^- `([a-z_]+)`", part, flags=re.M))
    top = part.split("Top-level fields:", 1)[1].split("\n\n", 1)[0]
    return sections, set(re.findall(r"`([a-z_]+)`", top))


def test_the_configuration_page_lists_the_schema_s_sections():
    schema = dataclasses.fields(JobConfig)
    sections = {
        f.name
        for f in schema
        if f.default_factory is not dataclasses.MISSING
        and dataclasses.is_dataclass(f.default_factory())
    }
    top_level = {f.name for f in schema} - sections
    assert "lora" in sections
    assert documented_sections() == (sections, top_level)
