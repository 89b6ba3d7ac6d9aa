"""bimetal.models: LLaMA-3 and Qwen2 as one single-device transformer, flavours, and HF import/export.

``build_model(family, args)`` gives the whole model; ``prune_to_stage`` cuts it to one pipeline stage;
``from_hf`` / ``export_hf`` read and write Hugging Face checkpoint folders (config.json + safetensors).
"""

from bimetal.models.args import ARGS_CLASSES, FLAVOURS, LlamaArgs, ModelArgs, Qwen2Args, RopeScaling
from bimetal.models.transformer import Transformer, build_model, prune_to_stage

__all__ = ["ARGS_CLASSES", "FLAVOURS", "LlamaArgs", "ModelArgs", "Qwen2Args", "RopeScaling", "Transformer",
           "build_model", "prune_to_stage"]
