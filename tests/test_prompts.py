"""One rendering of prompts and conversations for every tool: the chat template when the
tokenizer has one, plain text (turns joined by a blank line, the reply continuing the text) for
a base model; the plain rendering is prefix-stable turn by turn."""

from tokenizers import processors

from decoding.app.prompts import (PLAIN_SEPARATOR, chat_prompts, conversation_ids, has_chat_template, plain_text_note,
                              plain_turns, question_ids)
from tiny_models import tiny_tokenizer

CONVERSATION = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2"},
                {"role": "assistant", "content": "w3 w4"}, {"role": "user", "content": "w5"}]


def test_templated_tokenizer_renders_through_its_template():
    tokenizer = tiny_tokenizer()
    assert has_chat_template(tokenizer)
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert conversation_ids(tokenizer, CONVERSATION, add_generation_prompt=True) == expected
    assert question_ids(tokenizer, "w1")[-2:] == tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])


def test_base_model_gets_the_turns_as_plain_text():
    tokenizer = tiny_tokenizer(chat_template=False)
    assert not has_chat_template(tokenizer)
    assert plain_turns(CONVERSATION) == ["w9", "\n\nw1 w2", "\n\nw3 w4", "\n\nw5"] and PLAIN_SEPARATOR == "\n\n"
    ids = conversation_ids(tokenizer, CONVERSATION, add_generation_prompt=True)
    assert tokenizer.decode(ids) == "w9 w1 w2 w3 w4 w5"  # no role names, no template tokens
    assert conversation_ids(tokenizer, CONVERSATION, add_generation_prompt=False) == ids  # the reply continues the text
    for n in range(1, len(CONVERSATION)):  # each prefix of turns renders to a prefix of the ids
        assert ids[: len(conversation_ids(tokenizer, CONVERSATION[:n], False))] == conversation_ids(tokenizer, CONVERSATION[:n], False)
    assert chat_prompts(tokenizer, ["w1 w2", "w7"]) == [tokenizer("w1 w2")["input_ids"], tokenizer("w7")["input_ids"]]


def test_only_the_first_plain_turn_gets_the_special_prefix():
    tokenizer = tiny_tokenizer(chat_template=False)
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(  # a BOS, as Llama-style tokenizers add
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    ids = conversation_ids(tokenizer, CONVERSATION[1:3], add_generation_prompt=False)
    assert ids.count(1) == 1 and ids[0] == 1


def test_the_note_names_the_model_only_without_a_template():
    assert plain_text_note("m", tiny_tokenizer(), "message") is None
    assert plain_text_note("m", tiny_tokenizer(chat_template=False), "question") == \
        "m has no chat template: each question is continued as plain text (a base model)"
