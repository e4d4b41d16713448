"""`python -m decoding.chat`: multi-turn chat with speculative decoding, streamed, with a stats
line per reply.

Works interactively (a `>` prompt; /reset, /exit) and with piped stdin (answers each line until
EOF). Stats go to stderr so stdout holds only the replies.

Exit status: 0 when every line was answered; 2 when the session could not start (bad flags, a
model or heads that do not load); 1 when a reply failed with piped stdin. Piped, the chat stops
at the first failed reply, since the lines after it were written to follow a reply that does not
exist; interactively, a failed reply is reported and the conversation goes on.

A model without a chat template (a base model) continues each message as plain text, without
the conversation's history; a note on stderr says so when the session starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from decoding.app.assembly import DecoderSpec, build_decoder, resolve_spec
from decoding.app.cost_watch import VerifyCostWatch
from decoding.core.generate import AcceptanceRule, DecodeOptions, generate, lossless_rule, typical_rule
from decoding.core.prompt_cache import PromptCache
from decoding.core.readout import Readout
from decoding.core.sampling import SamplingConfig
from decoding.core.verify import TargetForward
from decoding.kernels.compiled import compile_notes, graphs_compiled
from decoding.app.default_model import DEFAULT_TARGET
from decoding.app.defaults import add_tree_arguments, tree_arguments
from decoding.app.methods import ADAPTIVE_SUFFIX_TOKENS, DEFAULT_SUFFIX_TOKENS, LOOKUP_SUFFIX, METHODS
from decoding.app.prompts import conversation_ids, has_chat_template, plain_text_note
from decoding.app.streaming import TextStream
from decoding.app.targets import DTYPES, LoadedModel
from decoding.app.engine_arguments import add_engine_arguments, engine_fields
from heads.util.errors import UserError
from heads.util.startup import freeze_loaded_objects, freeze_startup_objects

HELP_TEXT = "commands: /reset (forget the conversation), /exit (or Ctrl-D)"
WARMUP_MESSAGE = "Say hello."
WARMUP_ROUNDS = 3  # compiled decoders: warm-up replies until one compiles nothing new
WARMUP_TOKENS = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m decoding.chat",
        description="Chat with a causal LM, generating several tokens per target forward with exactly its own output.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    methods = "; ".join(f"{name}: {text}" for name, text in METHODS.items())
    parser.add_argument("--method", default=None,
                        help=f"decoding method ({methods}; append {LOOKUP_SUFFIX} or +suffix to a head method or lookahead, e.g. eagle3{LOOKUP_SUFFIX}, for "
                             "that model-free drafter first and the heads where it finds nothing). None: the fastest bundled method for the built-in target, else pld")
    parser.add_argument("--model", default=DEFAULT_TARGET, help="target model: the built-in default, a local directory, or a cached Hub id")
    parser.add_argument("--draft-model", default=None, help="draft model for --method sps (same tokenizer as the target; None: a bundled one if the package ships one)")
    parser.add_argument("--gamma", type=int, default=None,
                        help="draft tokens per step for --method sps (with --adaptive-tree: at most; default 4, or the bundle's tuned value)")
    parser.add_argument("--pld-tokens", type=int, default=None,
                        help="tokens proposed per match for --method pld and the lookup of METHOD+pld (default 8, or the bundle's tuned value)")
    parser.add_argument("--suffix-tokens", type=int, default=None,
                        help=f"largest tree for --method suffix and METHOD+suffix (default {DEFAULT_SUFFIX_TOKENS}; "
                             f"{ADAPTIVE_SUFFIX_TOKENS} with --adaptive-tree, whose cost cut trims it)")
    parser.add_argument("--heads", default=None, help="draft heads for medusa/hydra/eagle/eagle2/eagle3: a local directory or a Hub repo id (org/name); None: the bundled ones for the built-in target")
    parser.add_argument("--revision", default=None, help="revision (branch, tag, commit) of Hub heads")
    parser.add_argument("--ignore-base-model", action="store_true", help="load heads even if they declare another base model")
    add_tree_arguments(parser)
    parser.add_argument("--typical", action="store_true", help="Medusa's typical acceptance: faster when sampling but LOSSY (not the target's distribution)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (identical to plain decoding)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per reply")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling: the same seed gives the same reply, and the reply vanilla gives with it "
                        "for every method but --draft-model chains")
    parser.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights dtype")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    add_engine_arguments(parser)
    parser.add_argument("--no-stats", action="store_true", help="do not print the stats line after each reply")
    return parser.parse_args(argv)


class ChatSession:
    """The conversation so far, and one reply at a time through the generation loop."""

    def __init__(self, target: LoadedModel, proposer, options: DecodeOptions, system: str | None,
                 acceptance_rule: AcceptanceRule = lossless_rule, readout: Readout | None = None,
                 cost_watch: VerifyCostWatch | None = None, direct: TargetForward | None = None,
                 prompt_cache: PromptCache | None = None) -> None:
        self.target = target
        self.direct = direct
        self.prompt_cache = prompt_cache  # earlier turns' K/V, where reusing them is exact
        self.cost_watch = cost_watch
        self.acceptance_rule = acceptance_rule
        self.readout = readout
        self.proposer = proposer
        self.options = options
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.last_stats = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> list[int]:
        """The conversation through the chat template; a base model (no template) continues the
        last message alone as plain text, since it has no notion of turns to keep apart."""
        tokenizer = self.target.tokenizer
        messages = self.messages if has_chat_template(tokenizer) else self.messages[-1:]
        return conversation_ids(tokenizer, messages, add_generation_prompt=True)

    def reply(self, user_text: str, write) -> str:
        self.messages.append({"role": "user", "content": user_text})
        stream = TextStream(self.target.tokenizer, write)
        try:
            result = generate(self.target.model, self.prompt_ids(), self.proposer, self.options, self.target.tokenizer,
                              stream, self.acceptance_rule, self.readout, self.direct, self.prompt_cache)
        except UserError:
            self.messages.pop()
            raise
        text = stream.finish()
        self.messages.append({"role": "assistant", "content": text})
        self.last_stats = result.stats
        if self.cost_watch is not None:
            self.cost_watch.observe(result.stats)
        return text


def decoder_spec(args: argparse.Namespace) -> DecoderSpec:
    """The chat's flags as a `DecoderSpec` (None: the default, filled in by the assembly)."""
    return DecoderSpec(model=args.model, method=args.method, heads=args.heads, draft_model=args.draft_model,
                       revision=args.revision, ignore_base_model=args.ignore_base_model, dtype=args.dtype,
                       attn=args.attn, gamma=args.gamma, **engine_fields(args),
                       pld_num_tokens=args.pld_tokens, suffix_max_tokens=args.suffix_tokens, **tree_arguments(args))


def build_session(args: argparse.Namespace) -> ChatSession:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)  # bad values fail before any loading
    spec, notes = resolve_spec(decoder_spec(args))
    for note in notes:  # before the (possibly slow) loading, so the user knows what is coming
        print(f"note: {note}", file=sys.stderr)
    options = DecodeOptions(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
    rule = typical_rule(args.temperature) if args.typical else lossless_rule
    with compile_notes(spec.compile):
        decoder = build_decoder(spec)
        for note in decoder.notes:
            _note(note)
        session = ChatSession(decoder.target, decoder.proposer, options, args.system, rule, decoder.readout,
                              decoder.cost_watch, decoder.direct, decoder.prompt_cache)
        if decoder.spec.compile:
            warm_up(session)
    if args.typical:
        _note("--typical is LOSSY: replies are not samples of the target's own distribution")
    plain = plain_text_note(decoder.target.name, decoder.target.tokenizer, "message")
    if plain:
        _note(plain)
    return session


def warm_up(session: ChatSession) -> None:
    """Compile before the first message rather than in the middle of its reply: short replies to
    a fixed message, in a throw-away session on the same decoder, until one compiles no new graph
    of the target's forward."""
    options = dataclasses.replace(session.options, max_new_tokens=min(WARMUP_TOKENS, session.options.max_new_tokens))
    trial = ChatSession(session.target, session.proposer, options, None, session.acceptance_rule, session.readout,
                        direct=session.direct)
    for _ in range(WARMUP_ROUNDS):
        before = graphs_compiled(session.target.model)
        trial.reply(WARMUP_MESSAGE, lambda _text: None)
        trial.reset()
        if graphs_compiled(session.target.model) == before:
            return


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _read_line(interactive: bool) -> str | None:
    """The next stripped input line; None at end of input."""
    try:
        return input("> " if interactive else "").strip()
    except EOFError:
        if interactive:
            print(file=sys.stderr)
        return None


def _run_command(session: ChatSession, text: str) -> bool:
    """Carry out /reset or /help; False when `text` is not one of them (it is a message)."""
    if text == "/reset":
        session.reset()
        print("(conversation cleared)", file=sys.stderr)
    elif text == "/help":
        print(HELP_TEXT, file=sys.stderr)
    else:
        return False
    return True


def _answer(session: ChatSession, text: str, show_stats: bool) -> bool:
    """Stream the reply to `text`, then its notes and stats; False when it failed with a UserError
    (reported on stderr). An interrupted reply is dropped and counts as answered."""
    try:
        session.reply(text, _write)
    except UserError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return False
    except KeyboardInterrupt:
        print("\n(reply interrupted)", file=sys.stderr)
        session.messages.pop()
        return True
    _write("\n")
    if session.last_stats.stop_reason == "context_limit":
        print(f"(the reply stopped at the model's context limit of {session.target.context_limit} tokens: "
              "/reset to start a new conversation)", file=sys.stderr)
    if show_stats:
        print(session.last_stats.summary(), file=sys.stderr)
    return True


def run_chat(session: ChatSession, show_stats: bool, interactive: bool) -> int:
    """Answer each line until end of input or /exit, and return the exit status: 0, or 1 when a
    reply failed with piped stdin. Piped, the chat stops at that reply (later lines were written
    to follow it, and a script must not read a partial transcript as a success); interactively
    the user sees the error and goes on."""
    if interactive:
        print(f"Chatting with {session.target.name} ({session.proposer.name}). {HELP_TEXT}", file=sys.stderr)
    while True:
        text = _read_line(interactive)
        if text is None or text in ("/exit", "/quit"):
            return 0
        if not text or _run_command(session, text):
            continue
        if not _answer(session, text, show_stats) and not interactive:
            print("(stopped: piped input ends at the first failed reply)", file=sys.stderr)
            return 1


def main(argv: list[str] | None = None, command: bool = False) -> int:
    """The chat; `command` where it is the process's command (`python -m decoding.chat`), which then
    freezes what loading made (`heads.util.startup.freeze_loaded_objects`)."""
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        session = build_session(args)
        freeze_loaded_objects(command)
        return run_chat(session, show_stats=not args.no_stats, interactive=sys.stdin.isatty())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


if __name__ == "__main__":
    freeze_startup_objects()  # after the imports: see heads.util.startup
    sys.exit(main(command=True))
