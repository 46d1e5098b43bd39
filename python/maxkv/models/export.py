"""Writing a loaded model as a Hugging Face directory (float32 safetensors).

For tools that read only Hugging Face directories, such as MAX's own Llama
pipeline, and for ``max serve --model-path DIR --weight-path FILE.gguf`` (MAX
reads the configuration from ``DIR``, maxkv the weights from the file):
``python -m maxkv.models export gemma3-270m DIR`` writes ``config.json``,
``generation_config.json``, ``model.safetensors`` (the dequantized float32
weights under Hugging Face names; ``--no-weights`` leaves it out) and the
tokenizer files.  A GGUF file's
``config.json`` is the one transformers' GGUF loader builds from its metadata
(:func:`~maxkv.models.gguf_file.hf_config_from_metadata`), for every family;
a directory's is written as a ``LlamaForCausalLM`` (plain Llamas only).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import DecoderConfig, ModelLoadError
from .resolve import LoadedModel


def hf_config_dict(model: LoadedModel) -> dict[str, object]:
    """The ``config.json`` of ``model`` (float32): its GGUF file's, read as transformers
    reads it (any family), else a ``LlamaForCausalLM``'s.

    Raises:
        ModelLoadError: If the model is neither from a GGUF file nor a plain Llama.
    """
    if model.path is not None and model.path.suffix == ".gguf":
        from .gguf_file import hf_config_from_metadata, open_gguf

        reader = open_gguf(model.path)
        raw = hf_config_from_metadata(reader.fields, {t.name for t in reader.tensors})
        if DecoderConfig.from_hf(raw) != model.config:
            raise ModelLoadError(f"{model.path}: its config.json would not read back as loaded")
        return {**raw, "torch_dtype": "float32"}
    return llama_config_json(model.config)


def llama_config_json(config: DecoderConfig, torch_dtype: str = "float32") -> dict[str, object]:
    """A Hugging Face ``config.json`` (``LlamaForCausalLM``) of ``config``, whose
    weights are stored as ``torch_dtype``.

    Raises:
        ModelLoadError: If ``config`` is not a plain Llama (another family's
            options would be lost).
    """
    if not config.is_plain_llama():
        raise ModelLoadError(f"a {config.family} model is not exported as a LlamaForCausalLM")
    c = config
    eos: object = list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
    }


def export_hf_directory(model: LoadedModel, directory: str | Path, *, weights: bool = True) -> Path:
    """Writes ``model`` as a Hugging Face directory; returns it.

    ``weights=False``: the configuration and tokenizer only, what
    ``max serve --model-path DIR --weight-path FILE.gguf`` reads from ``DIR``
    (no float32 copy of a large model on disk, nor in memory while writing it).

    Raises:
        ModelLoadError: If ``directory`` exists and is not empty.
    """
    from safetensors.numpy import save_file

    out = Path(directory)
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(f"{out} is not empty; export into a new directory")
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if weights:
        tensors = {n: np.ascontiguousarray(a, np.float32) for n, a in model.weights.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.tokenizer.save_pretrained(str(out))
        # The file's own EOS (not the converted tokenizer's guess) ends generation.
        config_file = out / "tokenizer_config.json"
        tokenizer_config = json.loads(config_file.read_text())
        eos_id = model.config.eos_token_ids[0] if model.config.eos_token_ids else None
        if eos_id is not None:
            eos = model.tokenizer.tokenizer.convert_ids_to_tokens(eos_id)
            tokenizer_config["eos_token"] = eos
            tokenizer_config["pad_token"] = eos
        config_file.write_text(json.dumps(tokenizer_config, indent=2))
    return out
