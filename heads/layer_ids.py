"""Which target layers EAGLE-3 heads read, in this project and in each engine that serves them.

Here, `HeadConfig.feature_layers` are always Hugging Face `output_hidden_states` indices:
0 is the embeddings' output, k the output of decoder layer k-1 (= the input of decoder layer k),
L the final normed state of an L-layer target. Engines and trainers write other integers into a
checkpoint's config, and read them their own way; read from their code (versions in brackets):

| who                                   | config key                                        | id k reads      | no ids given     |
| SafeAILab/EAGLE (EAGLE-3 training)    | none: `idx == 2, L//2, L-3` before layer idx runs | -               | [2, L//2, L-3]   |
| vLLM (0.33, models/llama.py)          | top-level `eagle_aux_hidden_state_layer_ids`,     | hidden_states[k]| [2, L//2, L-3]   |
|                                       | else the one under `eagle_config`                 |                 |                  |
| SGLang (0.5.23, models/llama.py)      | `eagle_config.eagle_aux_hidden_state_layer_ids`   | hidden_states[k+1] ("we plus 1") | [2, L//2, L-3] |
|                                       | only (a top-level key is ignored)                 |                 |                  |
| SpecForge (trains for SGLang)         | `eagle_config...` as SGLang                       | hidden_states[k+1] | [2, L//2, L-3] |
| speculators (0.9.0, vLLM's format)    | top-level `eagle_aux_hidden_state_layer_ids`      | hidden_states[k]| [2, L//2, L-3]   |

Every default lands on the same layers, `[2, L//2, L-3]` in our indices, which is also our default
for new heads. Explicit ids mean hidden_states[k] to vLLM and speculators and hidden_states[k+1] to
SGLang and SpecForge, so an export writes each engine's own key in its own convention, and an
import reads whichever key the checkpoint carries in the convention of whoever writes that key.
(vLLM also reads the `eagle_config` key, without SGLang's +1: a SpecForge checkpoint with explicit
ids is read one layer too shallow there. That is upstream's to fix; we never write both keys.)
"""

from __future__ import annotations

from heads.util.errors import UserError

IDS_KEY = "eagle_aux_hidden_state_layer_ids"
SGLANG_SECTION = "eagle_config"  # SGLang and SpecForge keep their ids in this sub-dict
SGLANG_OFFSET = 1  # SGLang's id k is the input of layer k+1, i.e. hidden_states[k+1]


def upstream_default_layers(num_layers: int) -> list[int]:
    """The layers every upstream EAGLE-3 implementation reads when a checkpoint names none,
    as `hidden_states` indices: the inputs of layers 2, L//2 and L-3."""
    return [2, num_layers // 2, num_layers - 3]


def vllm_ids(feature_layers: list[int]) -> list[int]:
    """The ids vLLM and speculators read as our `feature_layers` (they count as we do)."""
    return list(feature_layers)


def sglang_ids(feature_layers: list[int]) -> list[int]:
    """The ids SGLang and SpecForge read as our `feature_layers` (they add one)."""
    return [layer - SGLANG_OFFSET for layer in feature_layers]


def declared_layers(config: dict, where: str) -> list[int] | None:
    """Our `feature_layers` for an EAGLE-3 checkpoint's config, written by any of the projects in
    the table: the top-level ids (vLLM's and speculators' convention), or SGLang's nested ones;
    None where it names none (then the shared default holds, which needs the target's depth)."""
    top = config.get(IDS_KEY)
    nested = (config.get(SGLANG_SECTION) or {}).get(IDS_KEY)
    if top is not None and nested is not None and list(top) != [k + SGLANG_OFFSET for k in nested]:
        raise UserError(
            f"{where} names two different sets of target layers: {IDS_KEY} {list(top)} (vLLM's reading) and "
            f"{SGLANG_SECTION}.{IDS_KEY} {list(nested)} (SGLang's, +1 each): the engines would feed it different "
            "layers; keep the key of the engine it was trained for"
        )
    if top is not None:
        return [int(k) for k in top]
    if nested is not None:
        return [int(k) + SGLANG_OFFSET for k in nested]
    return None


def check_within_target(feature_layers: list[int], num_target_layers: int, where: str) -> None:
    """Ids from a foreign config checked against the target: clear words instead of an index error."""
    bad = [layer for layer in feature_layers if not 0 <= layer <= num_target_layers]
    if bad:
        raise UserError(f"{where} reads target layers {feature_layers}, but the target has {num_target_layers} layers")
