"""The config_reader analyzer: refuse, from config.json alone, a transformers model that cannot be split.

The facts and the reasons are the core's (``diffuse.plan.verdicts``, which
``diffuse check`` prints as well); this analyzer puts the verdict in the draft
plan and raises the refusal before any model is built.
"""

from __future__ import annotations

from diffuse.plan.analysis import Analyzer
from diffuse.plan.verdicts import read_config, refusal_of
from diffuse.errors import RefusedModel


class ConfigReader(Analyzer):
    name = "config_reader"
    phase = "config"
    needs = ("component_libraries",)  # after remote_code: code shipped with the checkpoint is refused first
    provides = ("config_verdict",)
    description = ("From config.json alone: decoder depth, whether it generates, reads media or an encoder, carries "
                   "recurrent state; refuses recurrent models and encoders alone.")

    def analyze(self, subject, draft):
        if not subject.autoregressive:
            return {"config_verdict": {}}
        verdict = read_config(subject.denoiser_config)
        refusal = refusal_of(verdict)
        if refusal:
            raise RefusedModel(subject.path, refusal)
        return {"config_verdict": verdict}
