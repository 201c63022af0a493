"""Draft heads in other engines' layouts: official EAGLE-1, SafeAILab EAGLE-3 and speculators (vLLM),
read by `EagleDraftHead.from_pretrained` and written by `export_head`.

Each layout is a `config.json` and one weight file. A `pytorch_model.bin` is read with
``torch.load(weights_only=True)`` only: tensors, never pickled code. What differs from eaglespec's
own layout, and is converted here on the way in and out:

- EAGLE-1 (official ``eagle-llm``): FC input columns [embedding ; feature] (eaglespec's are
  [feature ; embedding]); no layer-0 input norm; a copy of the target's embedding
  (``embed_tokens.weight``), which official EAGLE loads strictly; no draft vocabulary.
- EAGLE-3, SafeAILab: the layer is ``midlayer.*``; ``lm_head`` is the head's own; ``d2t`` holds
  offsets (target id = i + d2t[i]); ``t2d`` marks the draft tokens in the target vocabulary; the aux
  layers are fixed by the target's depth (`eagle3_layers`).
- EAGLE-3, speculators: ``layers.0.*``, the layer's Llama config under ``transformer_layer_config``,
  the aux layers under ``eagle_aux_hidden_state_layer_ids``, and the target's embedding
  (``embed_tokens.weight``: speculators' own model reads it from the file).

This module converts configs and tensors only; it does not import the head (which imports it).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import LlamaConfig, PretrainedConfig

from ..errors import CheckpointError, EaglespecError, ShallowTargetError
from ..io import atomic_save_safetensors, atomic_torch_save, atomic_write_json

if TYPE_CHECKING:
    from .head import EagleDraftHead

HEAD_FORMAT = "eaglespec-draft-head"
HEAD_FORMAT_VERSION = 1
LAYOUTS = ("eaglespec", "eagle1", "eagle3", "speculators")  # what `detect` recognises and `export_head` writes
# the layer's fields every layout carries over from the target's config
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
                "attention_bias", "mlp_bias", "vocab_size", "bos_token_id", "eos_token_id")


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, mid and high layers of a target this deep (``output_hidden_states`` numbering:
    0 = the embeddings, i = the input of layer i), as official EAGLE-3 and vLLM pick them."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int] | None:
    """The layers an eagle3 head fuses unless told otherwise: `eagle3_layers`, where they are in
    order (a shallow target's may repeat one, as they do in the engines that pick them the same
    way); None for a target too shallow to have them."""
    layers = eagle3_layers(num_layers)
    return layers if layers[0] <= layers[1] <= layers[2] else None


def eagle3_default_aux_layers(num_layers: int) -> list[int]:
    """`default_aux_layers`, or one error that says to name the layers."""
    layers = default_aux_layers(num_layers)
    if layers is None:
        raise ShallowTargetError(f"a target of {num_layers} layers is too shallow for EAGLE-3's default aux "
                                 "layers (2, L // 2, L - 3): name three (--aux-layers)")
    return layers


def llama_layer_config(target: PretrainedConfig) -> LlamaConfig:
    """The decoder layer official EAGLE's and EAGLE-3's heads have whatever their target's family: a
    Llama layer with the target's shapes and RoPE and no biases (what official EAGLE, SafeAILab's,
    speculators' and llama.cpp's EAGLE-3 heads are)."""
    full = target.to_dict()
    layer = {k: full[k] for k in LAYER_FIELDS if k in full}
    layer.update(attention_bias=False, mlp_bias=False, num_hidden_layers=1)
    return LlamaConfig(**layer)


def swap_fc_inputs(fc: torch.Tensor) -> torch.Tensor:
    """An FC weight [H, 2H] with its two input halves swapped: EAGLE-1's [embedding ; feature] <->
    eaglespec's [feature ; embedding] (its own inverse)."""
    H = fc.shape[0]
    return torch.cat([fc[:, H:], fc[:, :H]], 1)


def renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    """`state` with the key prefix `old` replaced by `new` (SafeAILab's midlayer. <-> layers.0.)."""
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}


# -- reading --------------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A head folder's tensors: model.safetensors, else pytorch_model.bin (tensors only, never code)."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file() or not pt.is_file():
        try:
            return load_file(str(st))
        except FileNotFoundError:
            raise CheckpointError(f"{st}: missing (a head folder holds config.json and model.safetensors)") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{st}: not a readable safetensors file ({e})") from None
    try:
        state = torch.load(pt, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{pt}: not a plain tensor file ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{pt}: not a dictionary of tensors")
    return state


def resolve(path: str | os.PathLike) -> Path:
    """A head folder, or a Hugging Face repo id ("owner/name") found in the local hub cache (offline:
    nothing is downloaded)."""
    p = Path(path)
    if p.exists():
        return p
    parts = str(path).split("/")
    if len(parts) == 2 and all(parts) and not str(path).startswith((".", "~")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(str(path), local_files_only=True))
        except (LocalEntryNotFoundError, ValueError, OSError):
            raise CheckpointError(f"{path}: no such head folder, and no Hugging Face repo of that name in the "
                                  "local hub cache (huggingface-cli download it first)") from None
    raise CheckpointError(f"{path}: no such head folder")


def detect(path: str | os.PathLike) -> str:
    """Which layout a head folder holds (`LAYOUTS`); anything else is a `CheckpointError`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such head folder")
    cfg = read_json(path / "config.json")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path / 'config.json'}: not a JSON object")
    if cfg.get("format") == HEAD_FORMAT:
        return "eaglespec"
    if cfg.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "speculators_model_type" in cfg:
        raise CheckpointError(f"{path}: a speculators {cfg['speculators_model_type']!r} head; eaglespec reads eagle3 ones")
    if any("Eagle3" in str(a) for a in cfg.get("architectures") or []) or "draft_vocab_size" in cfg:
        return "eagle3"
    if cfg.get("num_hidden_layers") == 1 and "hidden_size" in cfg and "format" not in cfg:
        return "eagle1"
    raise CheckpointError(f"{path / 'config.json'}: not a draft head eaglespec knows (its own, EAGLE-1, "
                          f"EAGLE-3 or speculators; an eaglespec head has \"format\": \"{HEAD_FORMAT}\")")


def to_eaglespec(path: Path, layout: str, target: PretrainedConfig | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A foreign head folder as eaglespec's config and tensors. The layer's config is the target's
    (the same family) when given, else the file's fields."""
    cfg, state = read_json(path / "config.json"), dict(read_weights(path))
    if layout == "eagle1":
        layer_fields = cfg
        state.pop("embed_tokens.weight", None)  # official EAGLE's copy of the target's; eaglespec shares it
        fc = state.get("fc.weight")
        H = cfg.get("hidden_size")
        if fc is None or fc.dim() != 2 or fc.shape[1] != 2 * fc.shape[0] or fc.shape[0] != H:
            raise CheckpointError(f"{path}: fc.weight must be [{H}, {2 * H if isinstance(H, int) else '2H'}] "
                                  "(EAGLE-1's FC over [embedding ; feature])")
        state["fc.weight"] = swap_fc_inputs(fc)
        state.setdefault("fc.bias", torch.zeros(H, dtype=fc.dtype))  # "bias": false
        aux, d2t = [], None
    else:
        if layout == "speculators":
            layer_fields = cfg.get("transformer_layer_config")
            if not isinstance(layer_fields, dict):
                raise CheckpointError(f"{path / 'config.json'}: transformer_layer_config missing")
            if any(cfg.get(k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")):
                raise CheckpointError(f"{path}: a speculators head with extra norms (norm_before_residual, fc_norm, "
                                      "...) is not EAGLE-3's layer; eaglespec reads the plain one")
            aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        else:
            layer_fields, aux = cfg, None
            state = renamed(state, "midlayer.", "layers.0.")
        if aux is None:
            if target is None:
                raise CheckpointError(f"{path}: an EAGLE-3 head names no aux layers; load it with its target")
            aux = eagle3_layers(target.num_hidden_layers)
        if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux):
            raise CheckpointError(f"{path}: eagle_aux_hidden_state_layer_ids must be a list of layer indices")
        state.pop("embed_tokens.weight", None)
        t2d = state.pop("t2d", None)
        lm, offsets = state.pop("lm_head.weight", None), state.pop("d2t", None)
        if lm is None:
            raise CheckpointError(f"{path}: lm_head.weight missing (EAGLE-3's own LM head)")
        state["draft_lm_head.weight"] = lm
        d2t = None
        if offsets is not None:
            if offsets.dim() != 1 or offsets.numel() != lm.shape[0] or offsets.is_floating_point():
                raise CheckpointError(f"{path}: d2t must hold {lm.shape[0]} integer offsets, one per LM-head row")
            d2t = torch.arange(offsets.numel()) + offsets.long()
            state["d2t"] = d2t
        if layer_fields.get("vocab_size") is None and t2d is not None:
            layer_fields = {**layer_fields, "vocab_size": int(t2d.numel())}
    # every one of these layouts is a Llama layer, whatever the target's family (a Qwen2 target's head
    # carries its q/k/v biases as `attention_bias`): the target's shapes and RoPE, the file's biases
    if target is not None:
        full = target.to_dict()
        for key in ("hidden_size", "vocab_size"):
            if layer_fields.get(key, full[key]) != full[key]:
                raise CheckpointError(f"{path}: {key} {layer_fields.get(key)} is not the target's {full[key]}")
        layer = {k: full[k] for k in LAYER_FIELDS if k in full}
        layer.update({k: layer_fields[k] for k in ("attention_bias", "mlp_bias") if k in layer_fields})
    else:
        layer = {k: v for k, v in layer_fields.items() if k in LAYER_FIELDS}
    layer["model_type"] = "llama"
    layer["num_hidden_layers"] = 1
    if not isinstance(layer.get("hidden_size"), int) or not isinstance(layer.get("vocab_size"), int):
        raise CheckpointError(f"{path / 'config.json'}: hidden_size and vocab_size must be integers")
    if d2t is not None and (int(d2t.min()) < 0 or int(d2t.max()) >= layer["vocab_size"]):
        raise CheckpointError(f"{path}: d2t maps draft tokens outside the target's vocabulary")
    head_cfg = {"format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION,
                "model_type": "llama" if target is None else target.model_type,
                "hidden_size": layer["hidden_size"], "vocab_size": layer["vocab_size"],
                "input_mode": "feature+shifted_token", "aux_layers": list(aux),
                "arch": "eagle1" if layout == "eagle1" else "eagle3", "layer_config": layer}
    return head_cfg, state


# -- writing --------------------------------------------------------------------------------------
def export_head(head: "EagleDraftHead", layout: str, out: str | os.PathLike, target: PretrainedConfig | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """Write `head` in `layout` (`LAYOUTS`) to folder `out`. `target` (its config) is checked against
    what the layout fixes (SafeAILab's aux layers) and recorded where a layout names it
    (speculators' verifier); `dtype` casts the weights."""
    if layout not in LAYOUTS:
        raise EaglespecError(f"format must be one of {LAYOUTS}, got {layout!r}")
    out = Path(out)
    if layout == "eaglespec":
        head.save_pretrained(out, dtype=dtype)
        return out
    want = "eagle1" if layout == "eagle1" else "eagle3"
    if head.arch != want:
        raise EaglespecError(f"this head's arch is {head.arch}; only arch {want} has the {layout} layout "
                             f"(train one with --arch {want})")
    family = head.layer_config.model_type
    if family not in ("llama", "qwen2"):
        raise EaglespecError(f"the {layout} layout's layer is Llama's; a {family} layer has no such form")
    cfg = head.layer_config.to_dict()
    fields = {k: cfg[k] for k in LAYER_FIELDS if k in cfg}
    fields["num_hidden_layers"] = 1
    state = {k: v.detach().cpu() for k, v in head.state_dict().items() if not k.startswith("rotary.") and k != "d2t"}
    if family == "qwen2":  # Qwen2's layer is Llama's with q/k/v biases: Llama's attention_bias, o's bias zero
        fields["attention_bias"] = True
        o = state["layers.0.self_attn.o_proj.weight"]
        state["layers.0.self_attn.o_proj.bias"] = torch.zeros(o.shape[0], dtype=o.dtype)
    out.mkdir(parents=True, exist_ok=True)

    def cast(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
                for k, v in tensors.items()}

    if layout == "eagle1":
        state["fc.weight"] = swap_fc_inputs(state["fc.weight"])
        state["embed_tokens.weight"] = head.embed.weight.detach().cpu()
        atomic_torch_save(cast(state), out / "pytorch_model.bin")
        atomic_write_json({**fields, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True},
                          out / "config.json")
        return out
    if len(head.aux_layers) != 3 or sorted(head.aux_layers) != head.aux_layers:
        raise EaglespecError(f"EAGLE-3 layouts fuse three target layers, low to high; this head fuses {head.aux_layers}")
    state["lm_head.weight"] = state.pop("draft_lm_head.weight")
    ids = (head.d2t if head.d2t is not None else torch.arange(head.vocab_size)).long().cpu()
    state["d2t"] = ids - torch.arange(ids.numel())
    state["t2d"] = torch.zeros(head.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    dtype_name = str(dtype or torch.float32).replace("torch.", "")
    if layout == "eagle3":
        if target is not None and head.aux_layers != eagle3_layers(target.num_hidden_layers):
            raise EaglespecError(f"SafeAILab's EAGLE-3 reads layers {eagle3_layers(target.num_hidden_layers)} of "
                                 f"this target; this head fuses {head.aux_layers} (--format speculators names them)")
        state = renamed(state, "layers.0.", "midlayer.")
        atomic_save_safetensors(cast(state), out / "model.safetensors")
        atomic_write_json({**fields, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                           "draft_vocab_size": head.draft_vocab_size, "tie_word_embeddings": False,
                           "torch_dtype": dtype_name}, out / "config.json")
        return out
    layer = LlamaConfig(**{**fields, "tie_word_embeddings": False}).to_dict()
    layer["architectures"] = ["LlamaForCausalLM"]
    # speculators' own model takes the embedding from the file (vLLM and llama.cpp would share the
    # target's where it is missing): the target's, so that every reader drafts alike
    state["embed_tokens.weight"] = head.embed.weight.detach().cpu()
    atomic_save_safetensors(cast(state), out / "model.safetensors")
    atomic_write_json({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": layer, "draft_vocab_size": head.draft_vocab_size,
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "target_hidden_size": head.hidden_size, "eagle_aux_hidden_state_layer_ids": head.aux_layers,
        "has_no_defaults_at_init": False, "torch_dtype": dtype_name,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": getattr(target, "_name_or_path", None) or None,
                         "architectures": list(getattr(target, "architectures", None) or [])}},
    }, out / "config.json")
    return out
