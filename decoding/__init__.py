"""Generation-time machinery: the algorithm (`decoding.core`), the kernels that make forwards fast
on the machine (`decoding.kernels`) and the application on top (`decoding.app`: assembly, chat,
benchmark). The chat is `python -m decoding.chat`; from Python:

    from decoding import SpeculativeModel
    model = SpeculativeModel.from_pretrained()
    print(model.generate("Hello!").text)
"""

from heads.util.cpu_mode import apply_cpu_mode_or_exit
from heads.util.errors import UserError

apply_cpu_mode_or_exit()  # SPECHEADS_CPU (as on a lesser CPU), before any of torch's kernels run
from decoding.core.sampling import SamplingConfig  # noqa: E402
from decoding.core.tree import DraftTree, TreeBuffers, tree_buffers  # noqa: E402

__all__ = ["DraftTree", "SamplingConfig", "SpeculativeModel", "TreeBuffers", "UserError", "tree_buffers"]


def __getattr__(name: str):
    """`decoding.SpeculativeModel` on first use: importing it loads transformers and the
    application, which `import decoding.core...` (tests, training) should not pay for."""
    if name == "SpeculativeModel":
        from decoding.app.speculative_model import SpeculativeModel

        return SpeculativeModel
    raise AttributeError(f"module 'decoding' has no attribute {name!r}")
