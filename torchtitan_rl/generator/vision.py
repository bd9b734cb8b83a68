"""The generator's vision-language model: the torchtitan wrapper (vllm_model.py) taking vLLM's
multimodal inputs, and the processor vLLM runs on a request's images.

    .venv/bin/python -m pytest tests/integration/test_vision.py

A request's prompt ids already hold each image's run (`<|image_start|>` + n `<|patch|>` +
`<|image_end|>`, vision/prompts.py) and its `multi_modal_data` the images' patch rows and grids
as the trainer reads them (`types.Images`): no HF processor runs. vLLM only locates the runs
(an identity replacement whose target is the expanded run), hashes each image for its prefix
cache (a block over an image is keyed on it), and hands the rows to `embed_multimodal`, which
runs the torchtitan vision tower (`VisionLanguageModel.image_features`, each image alone, as
the trainer does) outside the compiled decoder; `embed_input_ids` writes the features at the
`<|patch|>` positions. For a multimodal model vLLM always hands the decoder embeddings, never
ids, so text-only models keep `TorchTitanForCausalLM`.

vLLM's encoder cache would key an image's features on its content alone, and a new policy would
read the older tower's: a request keys each image on its content and the policy version
(engine_requests.image_keys), and requests in flight across an update follow
generator.inflight_kv (`LocalGenerator.refresh_after_weight_update`).
"""

from collections.abc import Mapping

import torch
from transformers import BatchFeature
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import ModalityDataItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdateDetails,
)
from vllm.multimodal.processing.inputs import ProcessorInputs

from torchtitan_rl.generator.vllm_model import TorchTitanForCausalLM
from torchtitan_rl.models import model_spec
from torchtitan_rl.models.vision import each_image


def _fields(data: Mapping[str, torch.Tensor]) -> Mapping[str, MultiModalFieldConfig]:
    """Image i's rows are its grid's t * h * w rows of `pixel_values`; its grid a row of
    `image_grid_thw`, kept on the host (the encoder plans from it)."""
    grid = data.get("image_grid_thw", torch.empty((0, 3), dtype=torch.long))
    return {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
        "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
    }


class PreprocessedImages(ModalityDataItems[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]):
    """A request's images, preprocessed: {"pixel_values": [P, X], "image_grid_thw": [I, 3]}.
    Passed through to the model as they are (vLLM's `DictEmbeddingItems` is refused without
    `enable_mm_embeds`, a flag for user-given embeddings)."""

    def __init__(self, data: Mapping[str, torch.Tensor]) -> None:
        super().__init__(data, "image")
        rows, grid = data["pixel_values"].shape[0], data["image_grid_thw"]
        if int(grid.prod(-1).sum()) != rows:
            raise ValueError(f"{rows} patch rows for image grids {grid.tolist()}")
        self._items = MultiModalKwargsItems.from_hf_inputs(BatchFeature(dict(data)), _fields(data))

    def get_count(self) -> int:
        return len(self._items["image"])

    def get(self, index: int) -> Mapping[str, torch.Tensor]:
        """Image `index`'s rows and grid, what vLLM hashes: keys sorted, as the hasher walks a
        dict in order and `from_hf_inputs`' order follows a set's (PYTHONHASHSEED)."""
        data = self._items["image"][index].get_data()
        return {key: data[key] for key in sorted(data)}

    def get_processor_data(self) -> Mapping[str, object]:
        return {}  # no HF processor runs

    def get_passthrough_data(self) -> Mapping[str, object]:
        return self.data


class _Parser(MultiModalDataParser):
    def _parse_image_data(self, data) -> ModalityDataItems | None:
        if isinstance(data, dict):
            return PreprocessedImages(data)
        raise TypeError(
            "this generator takes images preprocessed ({'pixel_values', 'image_grid_thw'}: "
            "types.Images), not PIL images or URLs"
        )


class _Info(BaseProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_data_parser(self) -> MultiModalDataParser:
        return _Parser(expected_hidden_size=self._get_expected_hidden_size())

    def get_mm_max_tokens_per_item(self, seq_len, mm_counts) -> Mapping[str, int]:
        """`most_image_tokens`: vLLM sizes its encoder budget from it, processing no dummy
        image."""
        return {"image": most_image_tokens(self.get_hf_config(), seq_len)}


def most_image_tokens(config, seq_len: int) -> int:
    """The most placeholders an image has in an engine of `seq_len` tokens (max_model_len):
    the image processor's limit (vision/preprocess.py), or what the model length leaves the
    image's run between its two markers, whichever is less."""
    return max(1, min(config.torchtitan_max_image_tokens, seq_len - 2))


def _run(config, tokens: int) -> list[int]:
    start, patch, end = config.torchtitan_image_tokens
    return [start] + [patch] * tokens + [end]


def _grid(config, tokens: int) -> tuple[int, int, int]:
    """A square-ish grid of `tokens` merged patches (dummy inputs)."""
    side = max(int(tokens**0.5), 1)
    merge = config.torchtitan_merge_size
    return 1, side * merge, side * merge


class _Dummy(BaseDummyInputsBuilder[_Info]):
    """The largest image, for vLLM's encoder profile run (the engine skips it:
    `skip_mm_profiling`)."""

    def get_dummy_text(self, mm_counts) -> str:
        return ""

    def get_dummy_mm_data(self, seq_len, mm_counts, mm_options):
        config = self.info.get_hf_config()
        grid = torch.tensor([_grid(config, most_image_tokens(config, seq_len))])
        grid = grid.expand(mm_counts.get("image", 0), 3)
        rows = int(grid.prod(-1).sum())
        return {
            "image": {
                "pixel_values": torch.zeros(rows, config.torchtitan_row_size),
                "image_grid_thw": grid,
            }
        }


class _Processor(BaseMultiModalProcessor[_Info]):
    def get_dummy_inputs(self, seq_len, mm_counts, mm_options) -> ProcessorInputs:
        config = self.info.get_hf_config()
        data = self.dummy_inputs.get_dummy_mm_data(seq_len, mm_counts, mm_options)
        side = _grid(config, most_image_tokens(config, seq_len))
        tokens = side[1] * side[2] // config.torchtitan_merge_size**2
        prompt = _run(config, tokens) * mm_counts.get("image", 0)
        return ProcessorInputs(
            prompt=prompt, mm_data_items=self.info.parse_mm_data(data, validate=False)
        )

    def _get_mm_fields_config(self, hf_inputs: BatchFeature, hf_processor_mm_kwargs):
        return _fields(hf_inputs)

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        """Each image's run, already in the prompt, replaced by itself: vLLM locates it, and
        only its `<|patch|>` tokens take features."""
        config = self.info.get_hf_config()
        merge = config.torchtitan_merge_size

        def run(i: int) -> list[int]:
            t, h, w = (int(x) for x in out_mm_kwargs["image"][i]["image_grid_thw"].data)
            return _run(config, t * h * w // merge**2)

        patch = config.torchtitan_image_tokens[1]
        return [
            PromptReplacement(
                modality="image",
                target=run,
                replacement=lambda i: PromptUpdateDetails.select_token_id(run(i), patch),
            )
        ]

    def _apply_prompt_updates(self, token_ids, mm_prompt_updates):
        """The runs located by their ids alone, the ids kept as given: a missing run is one
        ValueError (vLLM's own would decode and re-encode the prompt as text, then fail an
        assert)."""
        ids, found, placeholders = self._apply_token_matches_with_placeholders(
            token_ids, mm_prompt_updates
        )
        missing = [i for i, update in enumerate(found.get("image", [])) if update is None]
        if missing or ids != token_ids:
            raise ValueError(
                f"image {missing[0] if missing else 0}: the prompt has no <|image_start|> + n "
                "<|patch|> + <|image_end|> run whose n is the image's (in image order)"
            )
        return ids, {modality: p for modality, p in placeholders.items() if p}


@MULTIMODAL_REGISTRY.register_processor(_Processor, info=_Info, dummy_inputs=_Dummy)
class TorchTitanVisionForCausalLM(TorchTitanForCausalLM, SupportsMultiModal):
    """`TorchTitanForCausalLM` for a vision-language flavor (models/vision.py): its vision
    tower encodes a request's images (module docstring)."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return "<|patch|>" if modality.startswith("image") else None

    def embed_multimodal(self, **kwargs) -> list[torch.Tensor]:
        """Features [n_i, D] of each image vLLM gives (its rows concatenated, its grid a row),
        in order: each encoded alone, as the trainer encodes it."""
        pixel_values, grid_I3 = kwargs["pixel_values"], kwargs["image_grid_thw"]
        if isinstance(pixel_values, list | tuple):
            pixel_values = torch.cat(list(pixel_values))
        encoder = self.model.vision_encoder
        pixel_values = pixel_values.to(encoder.conv1_linear.weight.device)
        images = each_image(pixel_values, grid_I3, encoder.patch_size, encoder.patch_temporal)
        return [self.model.image_features(rows, grid) for rows, grid in images]

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, *, is_multimodal=None):
        """The tokens' embeddings, the images' features at the positions `is_multimodal`
        marks (their `<|patch|>` tokens)."""
        h_TD = self.model.tok_embeddings(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return h_TD
        features_VD = torch.cat(list(multimodal_embeddings)).to(h_TD.dtype)
        return h_TD.masked_scatter(is_multimodal[:, None], features_VD)


def image_overrides(name: str, flavor: str, tokenizer, max_image_tokens: int) -> dict:
    """hf_overrides that tell the processor a vision flavor's image markers and sizes."""
    from torchtitan_rl.vision.preprocess import IMAGE_END, IMAGE_START, IMAGE_TOKEN

    encoder = model_spec(name, flavor).model.vision_encoder
    return {
        "torchtitan_image_tokens": tokenizer.convert_tokens_to_ids(
            [IMAGE_START, IMAGE_TOKEN, IMAGE_END]
        ),
        "torchtitan_max_image_tokens": max_image_tokens,
        "torchtitan_merge_size": encoder.downsample_factor,
        "torchtitan_row_size": encoder.patch_temporal * 3 * encoder.patch_size**2,
    }
