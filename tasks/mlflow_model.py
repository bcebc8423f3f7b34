"""The MLflow model of a trained checkpoint: a pyfunc that decodes with the project's Jacobi decoder.

Logged as "model from code": MLflow stores this file, the jfcore package and the
HF checkpoint folder (copied by path, never loaded at logging time). Loading
it anywhere with `mlflow.pyfunc.load_model(uri)` needs only torch and
transformers; `predict(["prompt", ...])` decodes with the model's tune for the
machine that loads it (or the untuned default), `params={"method": "multiblock"}`
overrides it; the completions are identical to greedy `generate`.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel


class JacobiForcingModel(PythonModel):
    def load_context(self, context) -> None:
        from jfcore.jacobi_forcing_json import decoding_for
        from jfcore.machine import this_machine
        from jfcore.models import ModelConfig, load_model

        self.checkpoint = context.artifacts["checkpoint"]
        self.model, self.tokenizer = load_model(ModelConfig(name_or_path=self.checkpoint))
        self.machine = this_machine(next(self.model.parameters()).device, self.model.dtype)
        decoding_for(self.checkpoint, self.machine)  # says once, at load, whether the tune holds here

    def predict(self, context, model_input, params: dict | None = None) -> list[str]:
        from jfcore.chat import encode_chat
        from jfcore.decoding import decode
        from jfcore.jacobi_forcing_json import decoding_for

        texts = model_input if isinstance(model_input, list) else list(model_input.iloc[:, 0])
        # MLflow fills what the caller left out from the signature's defaults: "tuned" and 0 mean "the model's own".
        settings = {k: v for k, v in (params or {}).items() if (k, v) not in (("method", "tuned"), ("block_size", 0))}
        prompts = [encode_chat(self.tokenizer, str(text)) for text in texts]
        out = decode(
            self.model,
            prompts,
            decoding_for(self.checkpoint, self.machine, len(prompts), settings, log=lambda _: None),
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        return self.tokenizer.batch_decode(out.sequences, skip_special_tokens=True)


mlflow.models.set_model(JacobiForcingModel())
