"""The MLflow model of a trained checkpoint: a pyfunc that decodes with the project's Jacobi decoder.

Logged as "model from code": MLflow stores this file, the jfcore package and the
HF checkpoint folder (copied by path, never loaded at logging time). Loading
it anywhere with `mlflow.pyfunc.load_model(uri)` needs only torch and
transformers; `predict(["prompt", ...], params={"method": "multiblock"})`
returns the completions, identical to greedy `generate`.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel


class JacobiForcingModel(PythonModel):
    def load_context(self, context) -> None:
        from jfcore.models import ModelConfig, load_model

        self.model, self.tokenizer = load_model(ModelConfig(name_or_path=context.artifacts["checkpoint"]))

    def predict(self, context, model_input, params: dict | None = None) -> list[str]:
        from jfcore.chat import encode_chat
        from jfcore.decoding import DecodeConfig, decode

        texts = model_input if isinstance(model_input, list) else list(model_input.iloc[:, 0])
        settings = params or {}  # MLflow fills what the caller left out from the signature's defaults
        prompts = [encode_chat(self.tokenizer, str(text)) for text in texts]
        out = decode(
            self.model,
            prompts,
            DecodeConfig(**settings),
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        return self.tokenizer.batch_decode(out.sequences, skip_special_tokens=True)


mlflow.models.set_model(JacobiForcingModel())
