"""The generator with images: the tiny vision-language Muse Glimmer in a real vLLM engine
(compiled, as users run it) in its own process (tests/helpers/vision_engine.py), its requests
carrying each prompt's images (generator/vision.py). The trainer's side and bitwise mode:
tests/unit/test_vision.py and tests/integration/test_batch_invariant.py.

    .venv/bin/python -m pytest tests/integration/test_vision.py
"""

import json
import shutil
from pathlib import Path

import torch
from helpers import runs
from helpers.launch import DEBUG_TOML, assert_resumed_as, metric_rows, run_helper, run_train
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


def test_the_generator_reads_images_as_the_trainer_does_and_keys_them_on_the_version():
    """One engine:
    - three prompts in one batch (two images of different shapes, one, none), two samples
      each: every sampled token's logprob is the torchtitan model's with the prompt's images
      within 1e-4 (fp32), a sampled `<|patch|>` in a completion read as text;
    - the prefix cache keys on the images: the same ids with the same image again give the
      same logprobs, with another image of the same size the other image's;
    - an image whose run the prompt cuts short is one line;
    - two turns of an agent's gateway session over HTTP, an image as a data URL in each: each
      turn samples what the engine's own generate does with the turn's seed and images, ids
      and logprobs equal (planted, the gateway not passing the images: not equal, 3.0 off the
      model), within 2e-4 of the torchtitan model (measured 1.1e-4 at one token of 12, fp32),
      and the session records both turns;
    - an environment's episodes of a prompt with an image, its reply to the first answer
      showing another image (helpers.user_envs:LookAgain): the continuous placement's
      (`Episodes.run_group` on the engine's stream) sample and score what the other
      placements' batched ones do with the same seed (the first turns' logprobs equal, the
      second turns' within 1e-5: they batch otherwise, measured 7e-7), and carry the same
      two images; every
      sampled token of both turns is the torchtitan model's with the episode's images within
      1e-4 (planted, the samples without the reply's image: 4.0 off; placed one id late:
      the generator refuses the request);
    - requests with one image streamed across updates of the tower (the continuous
      placement's): each token's logprob is the model's with the tower of the version that
      sampled it, within 1e-4, though an update moves them by more than 1 (measured 5.6).
      With generator.inflight_kv = "recompute" a request in flight is prefilled again with
      the new tower's features (planted, the cache not emptied: 2.9 off); with "keep" a
      request after the update reads no features of the older tower (planted, images keyed
      without the policy version: 5.1 off)."""
    figures = json.loads(run_helper("vision_engine.py").stdout.splitlines()[-1])
    assert figures["compiled"]
    assert figures["trainer_diff"] < 1e-4, figures
    assert figures["same_image_equal"] and figures["other_image_diff"] > 1e-3, figures
    assert figures["misplaced"] == "prompt 0: its image at 4 has no run of 2 placeholders"
    assert figures["gateway_same_as_generate"] and figures["gateway_diff"] < 2e-4, figures
    assert figures["gateway_images"] == 2 and figures["gateway_recorded"]
    assert figures["group_same_as_batched"] and figures["group_first_turns_equal"], figures
    assert figures["group_logprob_diff"] < 1e-5, figures
    assert figures["group_trainer_diff"] < 1e-4, figures
    # Two turns, two images (the row's, the reply's); one turn where the first hit max_tokens.
    assert 2 in figures["group_turns"], figures
    assert figures["group_images"] == figures["group_turns"], figures
    assert figures["recompute_versions"] == [0, 1] and figures["keep_versions"] == [1, 2]
    assert figures["tower_update_moves"] > 1.0, figures
    assert figures["recompute_diff"] < 1e-4, figures
    assert figures["keep_before_update_diff"] < 1e-4 and figures["keep_after_diff"] < 1e-4


def test_a_disaggregated_run_trains_on_images_its_generator_reads_and_resumes(tmp_path):
    """The vision demo's task (a question and an image per prompt) played by an environment
    whose reply to the first answer shows the image again, mirrored (helpers.user_envs:
    LookAgain), on 2 ranks, the generator on its own rank (disaggregated: requests, their
    images and the episodes' own cross a process boundary), the tower trained and synced,
    with the weight sync verified by digest: every step's generator and trainer logprobs
    agree within 5e-4 in fp32 over episodes of one and two turns (vLLM's CPU kernels against
    the trainer's: 7.5e-5 and 3.6e-5 on an AVX-512 EPYC, 1.02e-4 and 4.4e-5 on an AVX-512 Xeon;
    the vision demo's worst step 1.04e-4), which a generator that dropped an image would not
    (its placeholders read as text), nor a trainer whose rows lacked the reply's (planted,
    the samples without their own images: 6.4 off at step 1).

    Then the same command resumed from step 1's checkpoint (step 2's removed) logs step 2 as
    the uninterrupted run did, and exports the same weights bit for bit, the trained tower's
    included: the checkpoint holds the tower and its optimizer state, and the data and the
    generator pick up where they were."""
    flags = (
        *(
            "--job.config_file",
            DEBUG_TOML,
            *runs.VISION_MODEL,
            *runs.vision_task(tmp_path / "data", env="helpers.user_envs:LookAgain"),
            # A turn that ends by max_tokens ends its episode: digits stop most turns sooner.
            *("--generator.sampling.stop", *"0123456789"),
        ),
        *("--generator.placement", "disaggregated", "--generator.verify_weight_sync", "true"),
        *("--training.steps", "2", "--training.max_prompt_len", "256"),
        *("--generator.max_model_len", "320", "--training.prompts_per_step", "16"),
        *("--checkpoint.enable", "true", "--checkpoint.interval", "1"),
        *("--checkpoint.export_hf_at_end", "true"),
    )
    uninterrupted, resumed = tmp_path / "run", tmp_path / "resumed"
    result = run_train(*flags, "--job.dump_folder", str(uninterrupted), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(uninterrupted)
    assert len(rows) == 2
    assert all(0 < row["logprob_diff/max"] < 5e-4 for row in rows), rows
    assert all(row["reward/std"] > 0 and row["grad_norm"] > 0 for row in rows), rows
    assert all(1.2 < row["env/turns"] < 2 for row in rows), rows  # many two-turn episodes
    initial = load_file(REPO / "assets" / "tiny_vl_muse_glimmer" / "model.safetensors")
    trained = load_file(uninterrupted / "hf" / "model.safetensors")
    tower = [name for name in initial if name.startswith("model.vision_tower.")]
    assert tower and all(not torch.equal(trained[name], initial[name]) for name in tower)

    shutil.copytree(uninterrupted, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-2")
    shutil.rmtree(resumed / "hf")
    result = run_train(*flags, "--job.dump_folder", str(resumed), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoints' / 'step-1'}" in result.stdout
    assert_resumed_as(uninterrupted, resumed, 1, exact=False)


def test_an_agent_sends_images_through_the_gateway_in_a_continuous_run(tmp_path):
    """The vision demo's task played by an agent (helpers.user_envs:vision_agent: the row's
    messages as it gets them, each image a data URL, sent through its gateway session) in the
    continuous placement (1 trainer rank + 1 generator rank, each group streamed), the tower
    trained; 8 rows for 16 prompts a step, so that step 2 shows the generator every image
    again under new weights. With in-flight KV kept (no cache reset at an update) and every
    token on-policy (k = 0), both steps' generator and trainer logprobs agree within 1e-4:
    the trainer's rows carry the images each agent sent (planted, the samples without them:
    6.4 at step 1), and each image is encoded by the tower of the version that samples it
    (planted, images keyed without the policy version: 4.3 at step 2)."""
    flags = (
        *("--job.config_file", DEBUG_TOML, *runs.VISION_MODEL),
        *runs.vision_task(tmp_path / "data", train_rows=8),
        *("--task.name", "agent", "--task.agent", "helpers.user_envs:vision_agent"),
        *("--training.prompts_per_step", "16"),
        *("--generator.placement", "continuous", "--generator.inflight_kv", "keep"),
        *("--algorithm.max_offpolicy_steps", "0", "--training.steps", "2"),
        *("--training.max_prompt_len", "256", "--generator.max_model_len", "320"),
    )
    result = run_train(*flags, "--job.dump_folder", str(tmp_path / "run"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert len(rows) == 2
    assert all(0 < row["logprob_diff/on_policy_max"] < 1e-4 for row in rows), rows
    assert all(row["logprob_diff/max"] == row["logprob_diff/on_policy_max"] for row in rows)
    assert all(row["reward/std"] > 0 and row["grad_norm"] > 0 for row in rows), rows
