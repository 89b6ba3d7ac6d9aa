"""bimetal.models: LLaMA-3 and Qwen2 as one single-device transformer, flavours, and HF import/export.

``flavour_args(family, flavour)`` looks up a flavour's arguments; ``build_model(family, args)`` gives the
whole model; ``prune_to_stage`` cuts it to one pipeline stage (``build_stage`` builds a stage directly,
allocating only its own weights);
``from_hf`` / ``export_hf`` read and write Hugging Face checkpoint folders (config.json + safetensors).
"""

from bimetal.models.args import ARGS_CLASSES, FLAVOURS, LlamaArgs, ModelArgs, Qwen2Args, RopeScaling, flavour_args
from bimetal.models.hf import export_hf, from_hf
from bimetal.models.hf_config import args_from_hf_config, hf_config
from bimetal.models.transformer import Transformer, build_model, build_stage, prune_to_stage

__all__ = ["ARGS_CLASSES", "FLAVOURS", "LlamaArgs", "ModelArgs", "Qwen2Args", "RopeScaling", "Transformer",
           "args_from_hf_config", "build_model", "build_stage", "export_hf", "flavour_args", "from_hf", "hf_config",
           "prune_to_stage"]
