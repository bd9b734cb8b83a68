"""Muse Glimmer's vision tower as the project builds it (models/vision.py) against HF
transformers' `MuseGlimmerForConditionalGeneration` on the tiny vision-language checkpoint
(assets/tiny_vl_muse_glimmer, scripts/make_tiny_checkpoint.py), and the trainer on prompts
with images."""

import copy
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.titan import torchtitan_model

from torchtitan_rl import platform
from torchtitan_rl.models import model_spec
from torchtitan_rl.models.vision import (
    VisionEncoder,
    VisionLanguageModel,
    encoder_inputs,
    encoder_rows,
    vision_parameters,
)
from torchtitan_rl.types import RolloutBatch
from torchtitan_rl.vision.preprocess import ImageProcessorConfig, placeholder_count, preprocess
from torchtitan_rl.vision.prompts import prompt_images

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = REPO / "assets" / "tiny_vl_muse_glimmer"
PATCH, IMAGE_START, IMAGE_END = 68, 69, 70


def _images(*sizes: tuple[int, int], seed: int = 0) -> list[PIL.Image.Image]:
    rng = np.random.default_rng(seed)
    return [PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _prompt(grid_thw_N3: torch.Tensor) -> list[int]:
    """Text, then each image's placeholder run between its markers, then text."""
    ids = [3, 10, 11]
    for grid in grid_thw_N3:
        ids += [IMAGE_START] + [PATCH] * placeholder_count(grid, 2) + [IMAGE_END] + [12, 13]
    return ids + [14, 4, 3, 15]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(CHECKPOINT, attn_implementation="eager")


@pytest.fixture(scope="module")
def titan_model():
    return torchtitan_model(str(CHECKPOINT), "tiny_vl", "muse_glimmer")


def test_the_tokenizer_and_config_name_the_image_markers():
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    ids = tokenizer.convert_tokens_to_ids(["<|patch|>", "<|image_start|>", "<|image_end|>"])
    assert ids == [PATCH, IMAGE_START, IMAGE_END]
    assert AutoConfig.from_pretrained(CHECKPOINT).image_token_id == PATCH
    # The text ids are the text-only tiny checkpoint's.
    text_only = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny_muse_glimmer")
    assert tokenizer("abc 12")["input_ids"] == text_only("abc 12")["input_ids"]


def test_images_of_different_shapes_give_hf_logits(hf_model, titan_model):
    """Two images in one prompt, neither square (4x6 and 4x2 patches: windowed attention over
    2x2 windows, the learned positions resampled to each grid), through the encoder, the
    adapter, the projection and the scaleless norm into the decoder: HF's logits within the
    family's fp32 bound (test_tiny_checkpoint.py), at every position."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    pixel_values_PX, grid_thw_N3 = preprocess(_images((56, 84), (60, 30)), config)
    assert grid_thw_N3.tolist() == [[1, 4, 6], [1, 4, 2]]
    tokens_1T = torch.tensor([_prompt(grid_thw_N3)])
    with torch.no_grad():
        hf_logits = hf_model(
            input_ids=tokens_1T, pixel_values=pixel_values_PX, image_grid_thw=grid_thw_N3
        ).logits[0]
        positions_1T = torch.arange(tokens_1T.shape[1])[None]
        ours = titan_model(
            tokens_1T,
            positions=positions_1T,
            vision=_inputs(tokens_1T[0], pixel_values_PX, grid_thw_N3),
        )[0]
        # torchtitan's own injection (at every placeholder id, the images encoded together).
        theirs = titan_model(
            tokens_1T,
            positions=positions_1T,
            pixel_values=encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2),
            grid_thw=grid_thw_N3,
            special_tokens={"image_id": PATCH},
        )[0]
        text_only = titan_model(tokens_1T, positions=positions_1T)[0]
    torch.testing.assert_close(ours, hf_logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
    # The images are read: without them, the placeholders' logits are another model's.
    assert (text_only - hf_logits).abs().max() > 0.1


def _inputs(tokens_T: torch.Tensor, pixel_values_PX, grid_thw_N3):
    """The encoder's inputs for a prompt `tokens_T` holding the images' placeholder runs."""
    images = prompt_images(tokens_T.tolist(), pixel_values_PX, grid_thw_N3, PATCH, 2)
    return encoder_inputs([images], [0], 14, 2)


def test_a_placeholder_id_the_completion_samples_is_read_as_text(titan_model):
    """A sampled `<|patch|>` after the prompt is a token like any other (as the generator
    reads it): the features go where the prompt's images are, and torchtitan's injection
    (every placeholder id) would refuse the row."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    pixel_values_PX, grid_thw_N3 = preprocess(_images((28, 56)), config)
    prompt = _prompt(grid_thw_N3)
    tokens_1T = torch.tensor([prompt + [20, PATCH, PATCH, 21]])
    vision = _inputs(torch.tensor(prompt), pixel_values_PX, grid_thw_N3)
    with torch.no_grad():
        logits = titan_model(
            tokens_1T, positions=torch.arange(tokens_1T.shape[1])[None], vision=vision
        )[0]
        alone = titan_model(
            tokens_1T[:, : len(prompt) + 1],
            positions=torch.arange(len(prompt) + 1)[None],
            vision=vision,
        )[0]
        with pytest.raises(ValueError, match="counts must match"):
            titan_model(
                tokens_1T,
                positions=torch.arange(tokens_1T.shape[1])[None],
                pixel_values=encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2),
                grid_thw=grid_thw_N3,
                special_tokens={"image_id": PATCH},
            )
    torch.testing.assert_close(logits[: len(prompt) + 1], alone, rtol=1e-5, atol=1e-5)


def test_the_encoder_fixes_torchtitans_positions_for_images_not_square(hf_model, titan_model):
    """torchtitan 0.3.0's encoder samples a non-square grid's learned positions transposed;
    VisionEncoder's give HF's encoder output, and a square image's are torchtitan's own."""
    from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder

    encoder = titan_model.vision_encoder
    assert isinstance(encoder, VisionEncoder)
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    for size, square in (((56, 84), False), ((84, 84), True)):
        pixel_values_PX, grid_thw_N3 = preprocess(_images(size), config)
        with torch.no_grad():
            hf_out = hf_model.model.vision_tower(
                pixel_values=pixel_values_PX, grid_thw=grid_thw_N3
            ).last_hidden_state
            ours = encoder(encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2), grid_thw=grid_thw_N3)
            _, h, w = grid_thw_N3[0].tolist()
            theirs = MuseGlimmerVisionEncoder._get_pos_emb(encoder, h, w, torch.device("cpu"))
        torch.testing.assert_close(ours, hf_out, rtol=1e-5, atol=1e-5)
        mine = encoder._get_pos_emb(h, w, torch.device("cpu"))
        assert torch.equal(mine, theirs) == square


def test_images_batched_with_padding_encode_as_each_alone(titan_model):
    """Images of three sizes in one padded batch: each image's features are its features
    alone (padding rows attend to themselves only, so no NaN reaches a real row), and the
    patch rows are converted to torchtitan's (channel, temporal) layout, padded per image."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    images = _images((28, 28), (84, 56), (56, 56), seed=1)
    pixel_values_PX, grid_thw_N3 = preprocess(images, config)
    rows_NPX = encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2)
    assert rows_NPX.shape == (3, 24, 1176)
    assert torch.equal(rows_NPX[0, 4:], torch.zeros(20, 1176))
    # Row 0 of image 1 is its first patch row with the 2 frames and 3 channels swapped.
    first_row = pixel_values_PX[4].view(2, 3, 14, 14).transpose(0, 1).reshape(-1)
    assert torch.equal(rows_NPX[1, 0], first_row)
    encoder = titan_model.vision_encoder
    with torch.no_grad():
        together = encoder(rows_NPX, grid_thw=grid_thw_N3)
        alone = [
            encoder(encoder_rows(*preprocess([image], config), 14, 2), grid_thw=grid[None])
            for image, grid in zip(images, grid_thw_N3, strict=True)
        ]
    assert together.isfinite().all()
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-6)


def test_the_checkpoints_image_features_reach_the_scaleless_norm_at_unit_scale(titan_model):
    """The tiny checkpoint's adapter and projection are drawn at unit gain: the projected
    features reach the scaleless norm at a scale near 1, so the norm does not scale their
    gradients up. At torchtitan's init (std 0.02) they reach it at about 1e-3, and the
    norm's gradient, about 1 / scale, makes the tower's gradients dwarf the decoder's under
    gradient clipping: the vision demo then never learns (make_tiny_checkpoint.py)."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    pixel_values_PX, grid_thw_N3 = preprocess(_images((56, 84), seed=2), config)
    rows_NPX = encoder_rows(pixel_values_PX, grid_thw_N3, 14, 2)
    with torch.no_grad():
        adapted = titan_model.vision_adapter(
            titan_model.vision_encoder(rows_NPX, grid_thw=grid_thw_N3)
        )
        projected_VD = titan_model.vision_projection(adapted)
    rms_V = projected_VD.pow(2).mean(-1).sqrt()
    assert projected_VD.shape == (6, 128) and (rms_V > 0.1).all() and (rms_V < 10).all(), rms_V


def test_every_muse_glimmer_vision_flavor_builds_the_projects_model():
    """Every Muse Glimmer flavor with a vision tower builds `VisionLanguageModel` and
    `VisionEncoder` (dense masks), and the config refuses none of them; the text-only ones
    build none."""
    from torchtitan_rl.models import refused_parts

    for flavor in ("tiny_vl", "debugmodel_mm", "30B_mm"):
        config = model_spec("muse_glimmer", flavor).model
        assert isinstance(config, VisionLanguageModel.Config)
        assert isinstance(config.vision_encoder, VisionEncoder.Config)
        assert refused_parts("muse_glimmer", flavor) == ""
    assert model_spec("muse_glimmer", "tiny").model.vision_encoder is None


def _rows():
    """A batch of three rows: a prompt with two images, one with one, a text prompt, each
    followed by a completion (the first samples a placeholder id); its loss mask covers the
    completions, and each row's images say where their runs are."""
    config = ImageProcessorConfig.from_checkpoint(CHECKPOINT)
    g = torch.Generator().manual_seed(0)
    rows, images_B, masks = [], [], []
    for sizes in (((56, 84), (28, 28)), ((84, 56),), ()):
        images = None
        prompt = [3, 10, 11, 4, 3, 12]
        if sizes:
            pixel_values_PX, grid_thw_N3 = preprocess(_images(*sizes, seed=len(sizes)), config)
            prompt = _prompt(grid_thw_N3)
            images = prompt_images(prompt, pixel_values_PX, grid_thw_N3, PATCH, 2)
        completion = torch.randint(7, 60, (9,), generator=g).tolist()
        if len(sizes) == 2:
            completion[3] = PATCH
        rows.append(prompt + completion)
        masks.append([0.0] * len(prompt) + [1.0] * len(completion))
        images_B.append(images)
    width = max(map(len, rows))
    tokens_BT = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask_BT = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])
    return tokens_BT, mask_BT, tuple(images_B)


def _policy(**fields):
    from torchtitan_rl.config import ModelSection, ParallelismSection, TrainingSection
    from torchtitan_rl.trainer.policy_trainer import PolicyTrainer

    platform.patch_torchtitan()
    platform.init_distributed()

    training = fields.pop("training", TrainingSection())
    lora = fields.pop("lora", None)
    model = ModelSection(
        name="muse_glimmer", flavor="tiny_vl", hf_checkpoint=str(CHECKPOINT), **fields
    )
    return PolicyTrainer(
        model=model, training=training, parallelism=ParallelismSection(), lora=lora
    )


@pytest.mark.parametrize("micro_batch_tokens", [48, 0], ids=["packed", "padded"])
def test_the_trainers_logprobs_read_each_rows_images(titan_model, micro_batch_tokens):
    """Packed (under a budget that puts the rows in several packed rows, each image's
    features at its own row's placeholders) or right-padded, the trainer's logprobs of the
    completions are the model's on each row alone, with its images."""
    from torchtitan_rl.config import TrainingSection

    tokens_BT, mask_BT, images_B = _rows()
    policy = _policy(training=TrainingSection(micro_batch_tokens=micro_batch_tokens))
    if micro_batch_tokens:
        assert len(policy.plan(RolloutBatch(tokens_BT=tokens_BT, loss_mask_BT=mask_BT))) > 1
    logprobs_BT, _ = policy.logprobs(tokens_BT, mask_BT, images_B=images_B)
    for b, images in enumerate(images_B):
        length = int(mask_BT[b].nonzero().max()) + 1
        row_1T = tokens_BT[b : b + 1, :length]
        vision = None if images is None else encoder_inputs([images], [0], 14, 2)
        with torch.no_grad():
            logits = titan_model(row_1T, positions=torch.arange(length)[None], vision=vision)[0]
        expected = logits.log_softmax(-1)[:-1].gather(1, row_1T[0, 1:, None])[:, 0]
        scored = mask_BT[b, 1:length] > 0
        torch.testing.assert_close(
            logprobs_BT[b, 1:length][scored], expected[scored], rtol=1e-5, atol=1e-5
        )
    # Without its images a row's completion reads otherwise.
    text_BT, _ = policy.logprobs(tokens_BT[1:2], mask_BT[1:2])
    assert (text_BT[0] - logprobs_BT[1]).abs().max() > 1e-3


def test_rows_that_show_one_image_encode_it_once_and_sum_its_gradients(titan_model):
    """A prompt's samples share its `Images`: the tower encodes each distinct image once per
    forward and scatters its features to every row that shows it. The logits, and the tower's
    gradient (summed over the rows through the scatter), are the per-row path's (each row's
    own copy of its images, encoded for each row); the trainer's forward encodes once too."""
    from torchtitan_rl.config import TrainingSection

    tokens_BT, mask_BT, images_B = _rows()
    pick = [0, 0, 1, 1, 0, 2]  # two samples of row 1's prompt, three of row 0's, a text row
    tokens_BT, mask_BT = tokens_BT[pick], mask_BT[pick]
    shown = [images_B[b] for b in pick]
    width = tokens_BT.shape[1]
    offsets = [b * width for b in range(len(pick))]
    encoder = titan_model.vision_encoder
    calls = []
    hook = encoder.register_forward_hook(lambda *_: calls.append(1))
    weights_BT = torch.randn(tokens_BT.shape, generator=torch.Generator().manual_seed(1))
    results = []
    try:
        for images in (shown, [None if i is None else copy.copy(i) for i in shown]):
            calls.clear()
            titan_model.zero_grad()
            vision = encoder_inputs(images, offsets, 14, 2)
            logits_BTV = titan_model(tokens_BT, vision=vision)
            logprobs_BT = logits_BTV.log_softmax(-1).gather(2, tokens_BT[..., None])[..., 0]
            (weights_BT * logprobs_BT).sum().backward()
            grads = {n: p.grad.clone() for n, p in encoder.named_parameters()}
            results.append((len(calls), logits_BTV.detach(), grads))
        (once, logits, grads), (per_row, per_row_logits, per_row_grads) = results
        assert (once, per_row) == (3, 8)  # row 0's prompt has 2 images, row 1's 1
        torch.testing.assert_close(logits, per_row_logits, rtol=0, atol=0)
        assert any(g.abs().max() > 0 for g in grads.values())
        for name, grad in grads.items():  # fp32 sums in another order: 1e-5 of the scale
            scale = per_row_grads[name].abs().max()
            assert (grad - per_row_grads[name]).abs().max() <= 1e-5 * scale, name
        policy = _policy(training=TrainingSection(micro_batch_tokens=0))
        policy.model.vision_encoder.register_forward_hook(lambda *_: calls.append(1))
        calls.clear()
        policy.logprobs(tokens_BT, mask_BT, images_B=tuple(shown))
        assert len(calls) == 3
    finally:
        hook.remove()
        titan_model.zero_grad()


@pytest.mark.parametrize("window", [(2, 2), (3, 2), (4, 5)])
def test_the_windowed_layers_order_is_planned_on_the_host_as_torchtitans(titan_model, window):
    """The windowed layers' permutation, its inverse and window ids equal torchtitan's
    `_compute_sparse_perm_winid` for grids square or not, whole windows or not, up to a
    1024x768 image's (74 x 54 patches)."""
    from torchtitan.models.muse_glimmer.vision_encoder import MuseGlimmerVisionEncoder

    encoder = titan_model.vision_encoder
    saved = encoder.pos_emb_grid_h, encoder.pos_emb_grid_w
    encoder.pos_emb_grid_h, encoder.pos_emb_grid_w = window
    try:
        grids = [[1, 4, 6], [1, 10, 8], [1, 2, 2], [1, 14, 18], [1, 74, 54]]
        most = max(h * w for _, h, w in grids)
        ours = encoder._compute_sparse_perm_winid(grids, most, torch.device("cpu"))
        theirs = MuseGlimmerVisionEncoder._compute_sparse_perm_winid(
            encoder, grids, most, torch.device("cpu")
        )
    finally:
        encoder.pos_emb_grid_h, encoder.pos_emb_grid_w = saved
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.dtype == reference.dtype and torch.equal(mine, reference)


def test_the_vision_forward_reads_only_its_host_grids(titan_model):
    """On a GPU a read of a device tensor waits for the queue. The encoder's inputs keep each
    image's grid on the host, and the tower's forward reads nothing else: torchtitan's forward
    checks each host grid twice and lists it once; the windowed layers' order is planned from
    the grids (no `nonzero`, boolean index or `repeat_interleave` of device values)."""
    from helpers.host_syncs import HostSyncs

    tokens_BT, _, images_B = _rows()
    width = tokens_BT.shape[1]
    vision = encoder_inputs(list(images_B), [b * width for b in range(3)], 14, 2)
    assert all(grid.device.type == "cpu" for grid in vision.grids)
    assert titan_model.vision_encoder.sparse_attention_factor > 1  # windowed layers run
    with torch.no_grad(), HostSyncs() as syncs:
        titan_model(tokens_BT, vision=vision)
    assert dict(syncs.counts) == {
        ("_local_scalar_dense.default", "library < vision.image_features"): 2 * 3,
        ("tolist", "library < vision.image_features"): 3,
    }


def _image_batch() -> RolloutBatch:
    """`_rows()` as a batch to train on: an advantage per row, the generator's logprobs 0."""
    tokens_BT, mask_BT, images_B = _rows()
    return RolloutBatch(
        tokens_BT=tokens_BT,
        loss_mask_BT=mask_BT,
        advantages_B=torch.tensor([1.0, -1.0, 0.5]),
        generator_logprobs_BT=torch.zeros(mask_BT.shape),
        images_B=images_B,
    )


def _pg_loss(logprobs_BT, micro, scale):
    weighted = micro.advantages_B[:, None] * logprobs_BT * micro.loss_mask_BT
    return -weighted.sum() / scale.tokens, {}


def test_a_step_on_images_reads_the_device_once_as_a_text_step():
    """A step of the vision-language model, its tower trained, packed in 2 micro-batches of
    rows with images: besides the host plans (`HOST_PLANNERS`, and `IMAGE_PLANNERS`, which
    read the rows' host image grids), our code reads the device once, for the figures, as a
    text step does; the libraries read only host tensors: the tower's own grids
    (`test_the_vision_forward_reads_only_its_host_grids`) and AdamW's step counters."""
    from helpers.host_syncs import HOST_PLANNERS, IMAGE_PLANNERS, HostSyncs

    from torchtitan_rl.config import TrainingSection

    policy = _policy(freeze_vision=False, training=TrainingSection(micro_batch_tokens=48))
    batch = _image_batch()
    assert len(policy.plan(batch)) == 2
    policy.optimizer_step(batch, _pg_loss)  # the first builds the optimizer's state
    with HostSyncs() as syncs:
        policy.optimizer_step(batch, _pg_loss)
    planners = HOST_PLANNERS | IMAGE_PLANNERS
    ours = [c for c in syncs.calls if c[1] not in planners and not c[1].startswith("library")]
    assert ours == [
        ("cpu", "policy_trainer.optimizer_step"),
        ("tolist", "policy_trainer.optimizer_step"),
        ("tolist", "policy_trainer.optimizer_step"),  # the host totals
    ]
    planned = {caller for _, caller in syncs.calls if caller in IMAGE_PLANNERS}
    assert planned == IMAGE_PLANNERS  # the step ran the image path
    library = {(call, function) for call, function, _ in syncs.library}
    assert library == {
        ("_local_scalar_dense.default", "optimizer._get_value"),
        ("_local_scalar_dense.default", "vision_encoder.forward"),
        ("tolist", "vision_encoder.forward"),
    }


def test_the_vision_towers_blocks_train_under_activation_checkpointing():
    """training.activation_checkpoint wraps the vision encoder's blocks as the decoder's (their
    activations recomputed in backward, not kept): an unfrozen tower's step gives the
    gradients of the step without checkpointing, and its weights keep their names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from torchtitan_rl.config import TrainingSection

    batch = _image_batch()
    grads = {}
    for mode in ("none", "full"):
        training = TrainingSection(activation_checkpoint=mode)
        policy = _policy(freeze_vision=False, training=training)
        blocks = list(policy.model.vision_encoder.layers.values())
        assert all(isinstance(b, CheckpointWrapper) for b in blocks) == (mode == "full")
        seen = {}

        def record(*_, policy=policy, seen=seen):
            for name, p in policy.model.named_parameters():
                if name.startswith("vision_encoder.") and p.grad is not None:
                    seen[name.replace("_checkpoint_wrapped_module.", "")] = p.grad.full_tensor()

        hook = policy.optimizers.register_step_pre_hook(record)
        policy.optimizer_step(batch, _pg_loss)
        hook.remove()
        grads[mode] = seen
        assert "vision_encoder.layers.0.attn.wq.weight" in policy.state_dict()
    assert grads["none"].keys() == grads["full"].keys() and len(grads["none"]) > 10
    for name, grad in grads["none"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads["full"][name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["frozen", "trained", "lora"])
def test_the_vision_tower_trains_only_when_unfrozen(mode, tmp_path):
    """model.freeze_vision (the default): an optimizer step on image prompts leaves the vision
    tower as it was, without gradient or optimizer state, while the decoder moves; false: the
    tower moves too, and the HF export carries it to transformers. LoRA on every linear of
    the language model (target all): only its adapters move, none on the tower."""
    from torchtitan_rl.config import LoRASection, TrainingSection

    freeze_vision = mode != "trained"
    lora = LoRASection(enable=True, target="all") if mode == "lora" else None
    training = TrainingSection(lr=1e-2)
    policy = _policy(freeze_vision=freeze_vision, training=training, lora=lora)
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    policy.optimizer_step(_image_batch(), _pg_loss)
    after = policy.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    vision = {
        k
        for k in before
        if k.startswith(("vision_encoder.", "vision_adapter.", "vision_projection."))
    }
    assert any(k.startswith("layers.0.") for k in moved)
    if mode == "lora":
        assert moved and all(".lora_a." in k or ".lora_b." in k for k in moved), moved
        assert not any("lora" in k for k in vision)
    if freeze_vision:
        assert not moved & vision
        stateful = {p for state in policy.optimizers.optimizers[0].state for p in [state]}
        assert not any(p is q for p in stateful for q in vision_parameters(policy.model))
        return
    assert "vision_encoder.conv1_linear.weight" in moved and "vision_projection.weight" in moved
    # The HF export holds the trained tower, and transformers reads it.
    from transformers import AutoModelForImageTextToText

    from torchtitan_rl.hf_export import export_hf

    whole = {k: v.full_tensor() for k, v in after.items()}
    out = tmp_path / "hf"
    export_hf(whole, policy.spec, str(CHECKPOINT), str(CHECKPOINT), out)
    exported = AutoModelForImageTextToText.from_pretrained(out).model.vision_projection.weight
    assert torch.equal(exported, whole["vision_projection.weight"])
    assert not torch.equal(exported, before["vision_projection.weight"].full_tensor())
