"""Model names that resolve to local checkpoints, so nothing is downloaded at run time.

    path = nbkit.resolve_model("tiny:qwen3-vl")      # built on first use, then cached
    model = AutoModelForImageTextToText.from_pretrained(path)
    processor = nbkit.offline.load_processor(path)    # works with or without torchvision

Names (see MODELS):
- `tiny:qwen3`, `tiny:qwen3-vl`: the real transformers classes under 1 MB, random weights; they
  train on CPU in seconds (tests, CI, notebooks on laptops).
- `random:qwen3-1.7b`, `random:qwen3-8b`, `random:qwen3-14b`, `random:qwen3-32b`, `random:qwen3-vl-2b`,
  `random:qwen3-vl-4b`: the published shapes of Qwen/Qwen3-1.7B, -8B, -14B, -32B, Qwen/Qwen3-VL-2B-Instruct
  and Qwen/Qwen3-VL-4B-Instruct with random bf16 weights (speed and memory work on GPUs without a download).
- anything else is returned unchanged (a hub id or a local path).

Every checkpoint shares one byte-level BPE tokenizer trained here on the synthetic datasets'
vocabulary plus common English words, with Qwen's special tokens and a Qwen-like chat template of
our own. Its ids are all below the real vocabulary size, so the `random:` models keep their real
embedding shapes.

Checkpoints are built into a temporary directory next to the cache entry and renamed into place
under an fcntl lock: ranks resolving at once get one checkpoint, and a killed build never leaves a
half-written one. The directory name carries FORMAT_VERSION, bumped whenever what is written
changes, so stale caches are never reused.
"""

from __future__ import annotations

import copy
import fcntl
import importlib
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from nbkit.platform import compat
from nbkit.platform.config import setting
from nbkit.platform.patching import patch

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase, ProcessorMixin

__all__ = ["FORMAT_VERSION", "MODELS", "cache_root", "load_config", "load_processor", "resolve_model"]

FORMAT_VERSION = 1

# Qwen's special tokens, given the first ids so configs can name them without training anything.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKEN_IDS: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
# Upper bound of the trained tokenizer's ids, and the vocabulary size of the tiny models.
TOKENIZER_VOCAB = 1024

# Qwen-like ChatML. Content is a string or a list of {"type": "image" | "video" | "text"} parts;
# assistant turns sit in {% generation %} so TRL's assistant_only_loss can mask the rest.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part.type == 'image' or part.type == 'image_url' -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' -%}{{ part.text }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.role == 'assistant' -%}"
    "{%- generation -%}{{ render(message.content) + '<|im_end|>' }}{%- endgeneration -%}"
    "{%- else -%}{{ render(message.content) + '<|im_end|>' }}"
    "{%- endif -%}"
    "{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# Generic words so the tokenizer also covers everyday prompts, not only the synthetic tasks.
_ENGLISH = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first been call "
    "who its now find long down day did get come made may part over new sound take only little "
    "work know place year live me back give most very after thing our just name good sentence man "
    "think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must "
    "big even such because turn here why ask went men read need land different home us move try "
    "kind hand picture again change off play spell air away animal point page letter mother "
    "answer found study still learn should world high every near add food between own below "
    "country last school father keep never start city earth eye thought head under story saw left "
    "few while along might close something seem next hard open example begin life always those both "
    "paper together got group often run important until children side feet car mile night walk "
    "white sea began grow took begin hello please thank question image text assistant user system "
    "helpful describe explain image picture photo video color colour shape count yes no"
)


@dataclass(frozen=True)
class _Spec:
    """How to build one named model: its config fields and checkpoint conventions."""

    description: str
    vision: dict[str, Any] | None  # vision_config fields; None for text-only models
    text: dict[str, Any]  # text config fields (Qwen3Config or Qwen3VLTextConfig)
    dtype: str
    image_processor: dict[str, Any] = field(default_factory=dict)
    max_shard_bytes: int = 4 << 30


_TINY_TEXT = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Published shapes, from copies of the repositories' config.json: Qwen/Qwen3-1.7B; the text_config
# and vision_config of Qwen/Qwen3-VL-4B-Instruct (verbatim copies) and Qwen/Qwen3-VL-2B-Instruct
# (assembled from several partial copies: 2048 hidden, 6144 intermediate, 28 layers, 16/8 heads,
# rope_theta 5e6, vision out 2048). All tie their embeddings.
_QWEN3_1_7B_TEXT = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
# Qwen/Qwen3-8B, -14B and -32B: Qwen3-1.7B's layout wider and deeper, untied output embeddings (the dense
# models nbkit's FSDP benchmark trains where one T4 holds none of them in 16-bit, nor 32B even in 4-bit).
_QWEN3_8B_TEXT = dict(
    _QWEN3_1_7B_TEXT,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    tie_word_embeddings=False,
)
_QWEN3_14B_TEXT = dict(
    _QWEN3_1_7B_TEXT,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=40,
    num_attention_heads=40,
    tie_word_embeddings=False,
)
_QWEN3_32B_TEXT = dict(_QWEN3_14B_TEXT, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)
_VL_ROPE = dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True)
# Qwen3-VL-2B's language model has Qwen3-1.7B's shapes, with a longer context and multimodal RoPE.
_QWEN3_VL_2B_TEXT = dict(_QWEN3_1_7B_TEXT, max_position_embeddings=262144, rope_parameters=_VL_ROPE)
_QWEN3_VL_4B_TEXT = dict(
    _QWEN3_VL_2B_TEXT, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32
)
# The vision tower is the same for 2B and 4B; only its output width follows the text model.
_QWEN3_VL_VISION = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
    hidden_act="gelu_pytorch_tanh",
)
# Qwen3-VL's published preprocessor: 16px patches, 2x2 merge, 256x256 to 4096x4096 pixels.
_QWEN3_VL_IMAGES = dict(patch_size=16, min_pixels=65536, max_pixels=16777216)

_SPECS: dict[str, _Spec] = {
    "tiny:qwen3": _Spec(
        "Qwen3ForCausalLM, hidden 64, 2 layers, 140K random fp32 weights (0.6 MB); trains on CPU in seconds",
        vision=None,
        text=dict(_TINY_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dtype="float32",
    ),
    "tiny:qwen3-vl": _Spec(
        "Qwen3VLForConditionalGeneration, hidden 64, 2 text + 2 vision layers, 8px patches, 250K random "
        "fp32 weights (1 MB); trains on CPU in seconds (a 64x64 image is 16 tokens)",
        vision=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=8,
            temporal_patch_size=2,
            spatial_merge_size=2,
            num_position_embeddings=256,
            deepstack_visual_indexes=[0, 1],
            hidden_act="gelu_pytorch_tanh",
        ),
        text=dict(
            _TINY_TEXT,
            # M-RoPE sections (temporal, height, width) must add up to head_dim / 2 = 8.
            rope_parameters=dict(_VL_ROPE, mrope_section=[4, 2, 2]),
        ),
        dtype="float32",
        image_processor=dict(patch_size=8, min_pixels=32 * 32, max_pixels=448 * 448),
    ),
    "random:qwen3-1.7b": _Spec(
        "Qwen/Qwen3-1.7B shapes (1.72B parameters), random bf16 weights (3.4 GB on disk)",
        vision=None,
        text=_QWEN3_1_7B_TEXT,
        dtype="bfloat16",
    ),
    "random:qwen3-8b": _Spec(
        "Qwen/Qwen3-8B shapes (8.19B parameters), random bf16 weights (16.4 GB on disk)",
        vision=None,
        text=_QWEN3_8B_TEXT,
        dtype="bfloat16",
    ),
    "random:qwen3-14b": _Spec(
        "Qwen/Qwen3-14B shapes (14.8B parameters), random bf16 weights (29.5 GB on disk)",
        vision=None,
        text=_QWEN3_14B_TEXT,
        dtype="bfloat16",
    ),
    "random:qwen3-32b": _Spec(
        "Qwen/Qwen3-32B shapes (32.8B parameters), random bf16 weights (65.5 GB on disk)",
        vision=None,
        text=_QWEN3_32B_TEXT,
        dtype="bfloat16",
    ),
    "random:qwen3-vl-2b": _Spec(
        "Qwen/Qwen3-VL-2B-Instruct shapes (2.13B parameters), random bf16 weights (4.3 GB on disk)",
        vision=dict(_QWEN3_VL_VISION, out_hidden_size=2048),
        text=_QWEN3_VL_2B_TEXT,
        dtype="bfloat16",
        image_processor=_QWEN3_VL_IMAGES,
    ),
    "random:qwen3-vl-4b": _Spec(
        "Qwen/Qwen3-VL-4B-Instruct shapes (4.44B parameters), random bf16 weights (8.9 GB on disk)",
        vision=dict(_QWEN3_VL_VISION, out_hidden_size=2560),
        text=_QWEN3_VL_4B_TEXT,
        dtype="bfloat16",
        image_processor=_QWEN3_VL_IMAGES,
    ),
}

MODELS: dict[str, str] = {name: spec.description for name, spec in _SPECS.items()}

_PREFIXES = ("tiny:", "random:")


def _spec(name: str) -> _Spec | None:
    """The spec of an nbkit model name, None for other names; raises for unknown tiny:/random: names."""
    spec = _SPECS.get(name)
    if spec is None and name.startswith(_PREFIXES):
        raise ValueError(
            f"nbkit has no offline model {name!r}. Known names: {', '.join(MODELS)}. "
            "Any other name is passed through as a hub id or a local path."
        )
    return spec


# ---------------------------------------------------------------------------------------------
# configs


def load_config(model: str | os.PathLike[str] | PretrainedConfig, **hub_kwargs: Any) -> PretrainedConfig:
    """The transformers config of a model, without building or loading any weights.

    Safe on any rank; no CUDA. nbkit.plan and the model-loading guard read configs through it.

    Args:
        model: an nbkit name (tiny:..., random:...), anything AutoConfig.from_pretrained accepts
            (hub id, local path), or a PretrainedConfig (returned as it is).
        **hub_kwargs: passed to AutoConfig.from_pretrained (revision, token, cache_dir, ...).

    Returns:
        A Qwen3Config / Qwen3VLConfig built in code for nbkit names (identical to the config.json
        that resolve_model writes), AutoConfig.from_pretrained(model, **hub_kwargs) otherwise.

    Raises:
        ValueError: for unknown tiny:/random: names, and for a name whose config cannot be read (no
            local folder with a config.json, not on the hub or the hub unreachable), in one message
            with transformers' reason instead of its long chain of hub and file-system tracebacks.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    name = os.fspath(model)
    spec = _spec(name)
    if spec is not None:
        return _config(spec)
    try:
        return AutoConfig.from_pretrained(name, **hub_kwargs)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = " The hub is off (HF_HUB_OFFLINE=1)." if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise ValueError(
            f"Cannot read the config of {name!r}: it is not an nbkit name (tiny:..., random:...) nor a folder "
            f"with a config.json, and transformers could not find it on the hub.{offline} Its reason: {reason} "
            "Pass a local path, a name the hub has, or a PretrainedConfig."
        ) from None


def _config(spec: _Spec) -> PretrainedConfig:
    # Config classes may normalise nested dicts (rope parameters) in place: keep the specs pristine.
    text, vision = _rope_fields(copy.deepcopy(spec.text)), copy.deepcopy(spec.vision)
    ids: dict[str, Any] = dict(
        bos_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=TOKEN_IDS["<|im_end|>"],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
    )
    if vision is None:
        from transformers import Qwen3Config

        text_only = Qwen3Config(**text, **ids, dtype=spec.dtype)
        text_only.architectures = ["Qwen3ForCausalLM"]
        return text_only
    from transformers import Qwen3VLConfig

    config = Qwen3VLConfig(
        text_config=dict(text, **ids, dtype=spec.dtype),
        vision_config=dict({"out_hidden_size": text["hidden_size"]}, **vision),
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=text["tie_word_embeddings"],
        dtype=spec.dtype,
        **ids,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def _rope_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The text config's RoPE settings in the installed transformers' terms.

    The specs use transformers 5's `rope_parameters` (type, theta, M-RoPE sections in one dict);
    4.x reads `rope_theta` and, for anything beyond the default type, `rope_scaling` (Qwen3-VL's
    4.57 modeling code takes `mrope_section` from there and fails on a None).
    """
    if compat.transformers_major() >= 5:
        return text
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope if set(rope) - {"rope_type"} else None
    return text


def _model_class(config: PretrainedConfig) -> type:
    import transformers

    return getattr(transformers, cast(list[str], config.architectures)[0])


# ---------------------------------------------------------------------------------------------
# resolving and caching


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where checkpoints are kept: `cache_dir`, else $NBKIT_CACHE/models, else ~/.cache/nbkit/models."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = setting("cache")
    if env:
        return Path(env) / "models"
    return Path.home() / ".cache" / "nbkit" / "models"


def resolve_model(name: str, *, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Path of a local checkpoint for an nbkit model name; any other name comes back unchanged.

    For tiny:/random: names the checkpoint (config, tokenizer, chat template, processor files for VL
    models, safetensors weights) is built on first use and cached; later calls return the same path
    without rebuilding. The path loads with AutoConfig/AutoTokenizer/AutoModelForCausalLM/
    AutoModelForImageTextToText.from_pretrained (and AutoProcessor where torchvision is installed;
    use load_processor everywhere). Safe to call on every rank at once (a file lock lets one build
    while the others wait). Never touches CUDA, so it is safe in the notebook before launching.

    Args:
        name: an nbkit name (tiny:..., random:...), or anything else (returned as it is).
        cache_dir: where to keep the checkpoints (default: cache_root()).

    Returns:
        The checkpoint's local path for nbkit names, `name` otherwise.

    Raises:
        ValueError: for unknown tiny:/random: names.
    """
    spec = _spec(name)
    if spec is None:
        return name
    root = cache_root(cache_dir)
    final = root / f"{name.replace(':', '-')}-v{FORMAT_VERSION}"
    if final.is_dir():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we are killed
        if final.is_dir():  # another process built it while we waited
            return str(final)
        # We hold the lock, so any leftover build directory belongs to a build that died.
        for stale in root.glob(f".{final.name}.build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        build = Path(tempfile.mkdtemp(prefix=f".{final.name}.build-", dir=root))
        try:
            _build(spec, build)
            os.rename(build, final)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
    return str(final)


def _build(spec: _Spec, out: Path) -> None:
    config = _config(spec)
    config.save_pretrained(out)
    _generation_config().save_pretrained(out)
    tokenizer = _tokenizer(config.get_text_config().max_position_embeddings)
    tokenizer.save_pretrained(out)
    if spec.vision is not None:
        _write_processor_files(spec, out)
    _write_weights(config, spec, out)


def _generation_config() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=[TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"]],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
    )


# ---------------------------------------------------------------------------------------------
# tokenizer and processor files


def _tokenizer_corpus() -> Iterator[list[str]]:
    from nbkit.training import synthetic

    words = _ENGLISH.split()
    yield synthetic.corpus()
    yield words + [w.capitalize() for w in words] + [w.upper() for w in words]
    # Sentences of common words, so frequent pairs across word boundaries become merges too.
    yield [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 3)]
    yield ["system", "user", "assistant", "You are a helpful assistant.", "0123456789", "?!.,;:'\"()[]{}-+*/=<>"]


@lru_cache(maxsize=4)
def _tokenizer(model_max_length: int) -> PreTrainedTokenizerBase:
    """Byte-level BPE in Qwen2's pipeline (NFC, Qwen's split regex, byte-level), trained here."""
    tokenizer = _empty_qwen2_tokenizer().train_new_from_iterator(
        _tokenizer_corpus(),
        vocab_size=TOKENIZER_VOCAB,
        new_special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    if tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("nbkit's tokenizer training did not give the special tokens their fixed ids")
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = model_max_length
    return tokenizer


def _empty_qwen2_tokenizer() -> PreTrainedTokenizerBase:
    """A Qwen2 tokenizer with Qwen2's pipeline and no vocabulary yet, to train from.

    transformers 5's Qwen2Tokenizer builds exactly this when called without files; in 4.x that
    class is the slow, file-based one (it requires vocab_file and merges_file), so there the same
    pipeline is assembled from `tokenizers` parts and given to Qwen2TokenizerFast.
    """
    import transformers

    if compat.transformers_major() >= 5:
        return transformers.Qwen2Tokenizer()
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(BPE(vocab={"<|endoftext|>": 0}, merges=[], continuing_subword_prefix="", end_of_word_suffix=""))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    from transformers import Qwen2TokenizerFast  # type: ignore[attr-defined]  # 4.x only

    tokenizer = Qwen2TokenizerFast(tokenizer_object=backend)
    tokenizer.add_tokens([AddedToken("<|endoftext|>", special=True)])
    return tokenizer


def _write_processor_files(spec: _Spec, out: Path) -> None:
    # Written as plain JSON in the published Qwen3-VL layout rather than saved from processor
    # objects: CPU hosts only have the PIL image processor and no video processor, and the files
    # must name the classes a torchvision host should load ("...Fast" picks the best backend).
    images = spec.image_processor
    assert images is not None and spec.vision is not None  # only VL specs have processor files
    common = {
        "patch_size": images["patch_size"],
        "temporal_patch_size": spec.vision["temporal_patch_size"],
        "merge_size": spec.vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    image_config = dict(
        common,
        size={"shortest_edge": images["min_pixels"], "longest_edge": images["max_pixels"]},
        image_processor_type="Qwen2VLImageProcessorFast",
    )
    video_config = dict(
        common,
        size={"shortest_edge": 4096, "longest_edge": 25165824},
        video_processor_type="Qwen3VLVideoProcessor",
    )
    (out / "preprocessor_config.json").write_text(json.dumps(image_config, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# weights


_INIT_STD = 0.02
_CHUNK_ELEMENTS = 1 << 24  # one generator (and one thread pool task) per 16M values


def _write_weights(config: PretrainedConfig, spec: _Spec, out: Path) -> None:
    """Random weights straight into safetensors shards, never holding the whole model.

    Tensors are allocated shard by shard and filled in place: normal(0, 0.02) for matrices and
    embeddings, ones for norm weights, zeros for biases (transformers' own init would take minutes
    for billions of parameters on CPU). Chunks are filled in parallel, each from its own generator
    seeded by its position in the checkpoint, so the values depend neither on thread scheduling
    nor on how the checkpoint is split into files.
    """
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, spec.dtype)
    shards = _shards(_parameters(config), dtype.itemsize, spec.max_shard_bytes)
    seeds = itertools.count()
    weight_map: dict[str, str] = {}
    total = 0
    with ThreadPoolExecutor(max(1, min(32, os.cpu_count() or 1))) as pool:
        for number, shard in enumerate(shards, start=1):
            filename = "model.safetensors"
            if len(shards) > 1:
                filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors, jobs = {}, []
            for name, shape, fill in shard:
                tensor = tensors[name] = torch.empty(shape, dtype=dtype)
                if fill == "normal":
                    flat = tensor.view(-1)
                    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
                        jobs.append((flat[start : start + _CHUNK_ELEMENTS], next(seeds)))
                else:
                    tensor.fill_(1.0 if fill == "ones" else 0.0)
            list(pool.map(_fill_normal, jobs))
            save_file(tensors, str(out / filename), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, filename))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _parameters(config: PretrainedConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, "normal" | "ones" | "zeros") of every tensor the checkpoint stores.

    Learned from the real model class instantiated on the meta device (no memory, no init), so
    names match what from_pretrained expects; tied weights (lm_head) appear once, as in published
    checkpoints.
    """
    import torch

    with torch.device("meta"):
        model = _model_class(config)(config)
    entries = []
    for name, param in model.named_parameters():  # deduplicates tied parameters
        owner, _, leaf = name.rpartition(".")
        if leaf == "bias":
            fill = "zeros"
        elif "norm" in type(model.get_submodule(owner)).__name__.lower():
            fill = "ones"
        else:
            fill = "normal"
        entries.append((name, tuple(param.shape), fill))
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    unknown = set(model.state_dict()) - {name for name, _, _ in entries} - tied
    if unknown:
        raise RuntimeError(f"nbkit does not know how to initialise the non-parameter state {sorted(unknown)}")
    return entries


def _shards(entries: list[Any], itemsize: int, max_bytes: int) -> list[list[Any]]:
    """Consecutive groups of entries of at most max_bytes each (a larger tensor gets its own)."""
    shards: list[list[Any]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def _fill_normal(job: tuple[torch.Tensor, int]) -> None:
    import torch

    chunk, seed = job
    chunk.normal_(0.0, _INIT_STD, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# processors


def load_processor(name_or_path: str, **kwargs: Any) -> ProcessorMixin | PreTrainedTokenizerBase:
    """A working processor (or tokenizer, for text models) for a model name or checkpoint path.

    Where torchvision is installed, or the model needs no video processor, this is exactly
    AutoProcessor.from_pretrained. Without torchvision, transformers cannot build Qwen3-VL's
    processor at all (it insists on a video processor, and its class check rejects the real one);
    then the processor is assembled from AutoTokenizer, AutoImageProcessor (PIL backend) and the
    real video processor class, with the "offline" patch group fixing the class check. Images and
    text work fully (processor(images=, text=), apply_chat_template, TRL's vision collator);
    processing videos still needs torchvision.

    Args:
        name_or_path: an nbkit name (resolved with resolve_model), a hub id or a local path.
        **kwargs: passed to from_pretrained.

    Returns:
        The processor, or the tokenizer where the model has no processor.

    Raises:
        RuntimeError: where the video processor the checkpoint names cannot be built at all.
    """
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    path = resolve_model(name_or_path)
    processor_class = _processor_class(path)
    if (
        processor_class is None
        or is_torchvision_available()
        or "video_processor" not in _processor_attributes(processor_class)
    ):
        return AutoProcessor.from_pretrained(path, **kwargs)
    return _image_only_processor(processor_class, path, **kwargs)


def _processor_attributes(processor_class: Any) -> list[str]:
    """The parts a processor class is built from ("image_processor", "tokenizer", ...).

    transformers 5 asks the class (get_attributes()); 4.x lists them in the class attribute
    `attributes`.
    """
    get_attributes = getattr(processor_class, "get_attributes", None)
    return list(get_attributes() if get_attributes is not None else processor_class.attributes)


def _json_file(path: str, filename: str) -> dict[str, Any] | None:
    """A JSON file of a local checkpoint or a cached hub repository; None where there is none."""
    from transformers.utils import cached_file

    file = cached_file(path, filename, _raise_exceptions_for_missing_entries=False)
    return json.loads(Path(file).read_text()) if file else None


def _processor_class(path: str) -> type | None:
    """The processor class a checkpoint names, None where it names none."""
    import transformers

    for filename in ("processor_config.json", "preprocessor_config.json"):
        name = (_json_file(path, filename) or {}).get("processor_class")
        if name:
            return getattr(transformers, name, None)
    return None


def _image_only_processor(processor_class: type, path: str, **kwargs: Any) -> ProcessorMixin:
    from transformers import AutoConfig, AutoTokenizer

    # The top-level AutoImageProcessor is a torchvision placeholder here; the module's is real.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    from nbkit.platform import patching

    model_type = AutoConfig.from_pretrained(path).model_type
    video_type = (_json_file(path, "video_preprocessor_config.json") or {}).get("video_processor_type")
    try:
        # Without torchvision the top-level name is a placeholder; the defining module has the
        # real class, which is constructible (only processing videos needs torchvision).
        module = importlib.import_module(f"transformers.models.{model_type}.video_processing_{model_type}")
        video_class = getattr(module, video_type or "")
    except (ImportError, AttributeError, TypeError) as error:
        raise RuntimeError(
            f"{path} needs a video processor ({video_type}) that transformers cannot build without "
            "torchvision; install the torchvision build that matches your torch."
        ) from error
    patching.apply("offline")
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    return processor_class(
        image_processor=AutoImageProcessor.from_pretrained(path, **kwargs),
        tokenizer=tokenizer,
        video_processor=video_class.from_pretrained(path, **kwargs),
        chat_template=tokenizer.chat_template,
    )


def _torchvision_missing() -> bool:
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available()


@patch(
    "transformers.processing_utils:ProcessorMixin.check_argument_for_proper_class",
    reason=(
        "Without torchvision, ProcessorMixin checks video processors against the name "
        "BaseVideoProcessor looked up on the top-level transformers module, which is then a dummy "
        "placeholder, so every real video processor is rejected (from transformers 5.23 the lookup fails on the "
        "placeholder of the video processors' mapping instead) and no Qwen3-VL processor can be built for "
        "image-only use on CPU. Accept instances of the real base class before that lookup."
    ),
    upstream="https://github.com/huggingface/transformers/issues/48558",
    group="offline",
    when=_torchvision_missing,
)
def _accept_real_video_processors(original: Any) -> Any:
    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        from transformers.video_processing_utils import BaseVideoProcessor

        if "video_processor" in argument_name and isinstance(argument, BaseVideoProcessor):
            return BaseVideoProcessor
        return original(self, argument_name, argument)

    return check_argument_for_proper_class


@patch(
    "transformers.models.auto.processing_auto:AutoProcessor.from_pretrained",
    reason=(
        "Without torchvision, AutoProcessor.from_pretrained of a Qwen3-VL checkpoint raises ImportError "
        "(its video processor needs torchvision) even for image-only use: the natural call in a rank then "
        "gets the processor nbkit.offline.load_processor assembles (images and text work; videos still "
        "need torchvision)."
    ),
    upstream="https://github.com/huggingface/transformers/issues/48558",
    group="offline",
    when=_torchvision_missing,
)
def _auto_processor_without_torchvision(original: Any) -> Any:
    def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        except ImportError:
            path = str(pretrained_model_name_or_path)
            processor_class = _processor_class(path)
            if args or processor_class is None or "video_processor" not in _processor_attributes(processor_class):
                raise
            return _image_only_processor(processor_class, path, **kwargs)

    return from_pretrained
