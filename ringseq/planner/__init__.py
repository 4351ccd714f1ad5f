"""The planner: a cost model (``plan``) and an event simulator (``simulate``) of ring attention.

Pure Python and numpy, no torch: ``ringseq.plan`` is cheap to call. Formulas: docs/planner.md.
"""
from .hardware import Hardware, hardware, presets
from .model_spec import ModelSpec, model_spec
from .predict import Fix, ModeEstimate, Plan, Recommendation, longest, plan

__all__ = ["Fix", "Hardware", "ModeEstimate", "ModelSpec", "Plan", "Recommendation", "hardware", "longest", "model_spec",
           "plan", "presets"]
