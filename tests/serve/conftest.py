"""A replica needs torch (a Hugging Face one, transformers, imported on load), never what a
training rank adds (torch._dynamo, raymesh.train's modules): warm procs import torch alone."""

from tests.conftest import warm_procs_import

_warm_procs_import_torch = warm_procs_import("torch")
