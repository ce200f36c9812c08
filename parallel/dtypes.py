"""Model dtypes by their config names (``model.dtype``), for every place that builds a model."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
