"""Chat templates (services/inference/chat.py) render exactly as transformers' `apply_chat_template(tokenize=False)`
does (the reference here); refuse and fail as one TemplateError; stay inside the sandbox and the length bound."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.chat import ChatMessage, ChatTemplate, TemplateError, stop_token_ids
from services.inference.device.checkpoint import CheckpointError, read_header
from tests.checkpoints import CHATML_TEMPLATE, EOS, build_tokenizer, save_chatml_checkpoint
from tests.inference.chat_templates import (
    ACCEPTS,
    CONVERSATIONS,
    GEMMA_LIKE,
    INLINE,
    LLAMA3_LIKE,
    PLAIN,
    SPECIAL,
    SYSTEM,
    ZEPHYR_LIKE,
)


def as_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {}) for m in messages]


def reference(hf: PreTrainedTokenizerFast, messages, add_generation_prompt: bool, chat_template=None) -> str:
    return hf.apply_chat_template(
        as_dicts(messages), chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.fixture(scope="module")
def hf_inline() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), **SPECIAL)


# chatml_dir (tests/inference/conftest.py) carries the template in tokenizer_config.json; this one beside it
@pytest.fixture(scope="module")
def chatml_jinja_dir(tmp_path_factory) -> Path:
    return save_chatml_checkpoint(tmp_path_factory.mktemp("chatml-jinja"), template_file=True)


def write_dir(root: Path, config: dict, template: str | None = None) -> Path:
    build_tokenizer().save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (root / "chat_template.jinja").write_text(template)
    return root


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(
    ("name", "conversation"), [(name, c) for name in INLINE for c in ACCEPTS.get(name, CONVERSATIONS)]
)
def test_inline_templates_render_as_transformers(hf_inline, name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = ChatTemplate(INLINE[name], SPECIAL).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == reference(hf_inline, messages, add_generation_prompt, chat_template=INLINE[name])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("where", ["chatml_dir", "chatml_jinja_dir", "bundled"])
def test_checkpoint_templates_render_as_transformers(request, where, conversation, add_generation_prompt):
    model_dir = BUNDLED_MODEL if where == "bundled" else request.getfixturevalue(where)
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    template = ChatTemplate.from_dir(model_dir)
    messages = CONVERSATIONS[conversation]
    assert template.render(messages, add_generation_prompt) == reference(hf, messages, add_generation_prompt)


def test_chatml_renders_its_turns_and_the_assistant_opening(chatml_dir):
    template = ChatTemplate.from_dir(chatml_dir)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"), ChatMessage("tool", "3", name="calc")]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n"
    )
    assert template.render(messages, add_generation_prompt=False) == expected
    assert template.render(messages) == expected + "<|im_start|>assistant\n"


def test_bundled_template_frames_the_conversation_as_python():
    template = ChatTemplate.from_dir(BUNDLED_MODEL)
    messages = [
        ChatMessage("system", "Helpers for files."),
        ChatMessage("user", "Count lines.\nSkip blank ones."),
        ChatMessage("assistant", "def count(path):\n    return 0\n"),
        ChatMessage("tool", "0", name="run"),
    ]
    assert template.render(messages) == (
        '"""Helpers for files."""\n\n# User: Count lines.\n# Skip blank ones.\n\n\n'
        "def count(path):\n    return 0\n<|endoftext|># Tool (run): 0\n\n\n"
    )


@pytest.mark.parametrize("where", ["chatml_dir", "bundled"])
def test_a_finished_assistant_turn_is_the_generation_prompt_then_its_content_and_end(request, where):
    # what the model is asked to continue, plus what it writes and its end of turn, is the conversation with that turn
    template = ChatTemplate.from_dir(BUNDLED_MODEL if where == "bundled" else request.getfixturevalue(where))
    before = [SYSTEM, ChatMessage("user", "Reverse a list.")]
    answer = ChatMessage("assistant", "def rev(xs):\n    return xs[::-1]")
    after = template.render([*before, answer], add_generation_prompt=False)
    assert after.startswith(template.render(before) + answer.content + template.end_of_turn())


def test_raise_exception_is_a_template_error_with_the_templates_message(hf_inline):
    messages = CONVERSATIONS["tools"]
    with pytest.raises(jinja2.TemplateError, match="Zephyr has no role tool"):
        reference(hf_inline, messages, True, chat_template=ZEPHYR_LIKE)
    with pytest.raises(TemplateError, match="^the chat template refused the messages: Zephyr has no role tool$"):
        ChatTemplate(ZEPHYR_LIKE, SPECIAL).render(messages)
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate(GEMMA_LIKE, SPECIAL).render([ChatMessage("user", "a"), ChatMessage("user", "b")])


def test_a_templates_message_is_clipped():
    with pytest.raises(TemplateError) as caught:
        ChatTemplate("{{ raise_exception('x' * 1000) }}").render(CONVERSATIONS["one-turn"])
    assert "xxxx" in str(caught.value) and len(str(caught.value)) <= 256


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ strftime_now.__globals__.os }}",
        "{{ (messages | attr('__class__')).__mro__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ dict.__class__.__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ namespace(_secret=1) }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{{ messages[0].update(role='system') }}",
        "{{ messages.pop() }}",
    ],
)
def test_the_sandbox_refuses_unsafe_access_as_a_template_error(source):
    with pytest.raises(TemplateError, match="SecurityError"):
        ChatTemplate(source).render(CONVERSATIONS["one-turn"])


def test_dict_is_a_builder_not_the_type(hf_inline):
    # with the type itself a template could walk its methods (dict.mro() is a safe name); transformers hands a builder
    source = "{{ dict.mro() }}"
    with pytest.raises(jinja2.TemplateError, match="no attribute 'mro'"):
        reference(hf_inline, CONVERSATIONS["one-turn"], True, chat_template=source)
    with pytest.raises(TemplateError, match="UndefinedError: .* has no attribute 'mro'"):
        ChatTemplate(source).render(CONVERSATIONS["one-turn"])


def test_an_unsafe_attribute_left_unused_renders_as_nothing(hf_inline):
    # the sandbox hands back an undefined value that fails only when used: printed, it is empty, as in transformers
    source = "[{{ ''.__class__ }}{{ raise_exception.__globals__ }}{{ lipsum.__globals__ }}{{ dict.__class__ }}]"
    assert ChatTemplate(source).render(CONVERSATIONS["one-turn"]) == "[]"
    assert reference(hf_inline, CONVERSATIONS["one-turn"], True, chat_template=source) == "[]"


def test_failures_of_the_template_are_template_errors(hf_inline):
    with pytest.raises(ValueError, match="empty conversation"):
        reference(hf_inline, [], True, chat_template=CHATML_TEMPLATE)
    with pytest.raises(TemplateError, match="no messages"):
        ChatTemplate(CHATML_TEMPLATE).render([])
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(CONVERSATIONS["one-turn"])
    with pytest.raises(TemplateError, match="UndefinedError"):
        ChatTemplate("{{ messages[5]['content'].strip() }}").render(CONVERSATIONS["one-turn"])


def test_the_environment_is_the_one_transformers_gives(hf_inline):
    source = (
        "{{ tools is defined }} {{ tools is none }} {{ documents is none }} {{ unk_token is defined }} "
        "{{ bos_token }}{{ eos_token }} {{ {'x': '<é>'} | tojson }} {{ dict(a=1) }} {{ dict.fromkeys(['k']) }} "
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    ours = ChatTemplate(source, SPECIAL).render(CONVERSATIONS["tools"])
    assert ours == reference(hf_inline, CONVERSATIONS["tools"], True, chat_template=source)
    assert ours == "True True True False <s></s> {\"x\": \"<é>\"} {'a': 1} {'k': None} user"


def test_strftime_now_is_the_local_time():
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render(CONVERSATIONS["one-turn"])
    assert rendered in (before, datetime.now().strftime("%Y-%m-%d"))


def test_the_rendered_length_is_bounded():
    messages = [ChatMessage("user", "x" * 100)]
    repeats = ChatTemplate("{% for i in range(1000) %}{{ messages[0].content }}{% endfor %}")
    assert len(repeats.render(messages, max_chars=100_000)) == 100_000
    with pytest.raises(TemplateError, match="more than 99999 characters"):
        repeats.render(messages, max_chars=99_999)
    # one expression that would build a long string (or a huge number) is refused before it is built, even when
    # what it writes would be short
    with pytest.raises(TemplateError, match="more than 1000 characters"):
        ChatTemplate("{{ (messages[0].content * 100000) | length }}").render(messages, max_chars=1000)
    with pytest.raises(TemplateError, match="too large a power"):
        ChatTemplate("{{ (7 ** 100000) % 10 }}").render(messages)
    assert (
        ChatTemplate("{{ messages[0].content * 2 }}{{ 2 ** 10 }}").render(messages, max_chars=204) == "x" * 200 + "1024"
    )


def test_renders_from_many_threads_each_with_its_own_bound():
    template = ChatTemplate("{{ messages[0].content * 2 }}")
    messages = [ChatMessage("user", "y" * 3000)]
    results: list[object] = []

    def work(i: int) -> None:
        for _ in range(200):
            # even threads bound the render below what `* 2` builds, odd ones above it: no bound leaks across
            try:
                results.append(template.render(messages, max_chars=1000 if i % 2 == 0 else 1 << 20))
            except TemplateError as exc:
                results.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(isinstance(r, TemplateError) for r in results) == 800
    assert sum(r == "y" * 6000 for r in results) == 800


def test_from_dir_without_a_template_is_none(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None
    assert ChatTemplate.from_dir(write_dir(tmp_path, {"eos_token": "</s>"})) is None


def test_from_dir_takes_the_default_of_named_templates(tmp_path):
    named = [
        {"name": "tool_use", "template": "tools{{ eos_token }}"},
        {"name": "default", "template": "dflt{{ eos_token }}"},
    ]
    model_dir = write_dir(tmp_path, {"eos_token": "</s>", "chat_template": named})
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    rendered = ChatTemplate.from_dir(model_dir).render(CONVERSATIONS["one-turn"])
    assert rendered == "dflt</s>" == reference(hf, CONVERSATIONS["one-turn"], True)


def test_from_dir_refuses_named_templates_without_a_default(tmp_path):
    model_dir = write_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "t"}]})
    with pytest.raises(CheckpointError, match="tokenizer_config.json.*no chat template named 'default'"):
        ChatTemplate.from_dir(model_dir)


def test_the_jinja_file_wins_over_the_config_and_special_tokens_may_be_added_token_dicts(tmp_path):
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": "config",
    }
    model_dir = write_dir(tmp_path, config, template="file {{ bos_token }}{{ eos_token }}")
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    rendered = ChatTemplate.from_dir(model_dir).render(CONVERSATIONS["one-turn"])
    assert rendered == "file <s></s>" == reference(hf, CONVERSATIONS["one-turn"], True)


def test_a_template_that_does_not_compile_names_its_file(tmp_path):
    with pytest.raises(ValueError, match="does not compile: line 1"):
        ChatTemplate("{% for message in messages %}")
    with pytest.raises(CheckpointError, match="chat_template.jinja.*does not compile"):
        ChatTemplate.from_dir(write_dir(tmp_path, {}, template="{{ messages[ }}"))


def test_a_message_has_one_of_the_four_roles():
    with pytest.raises(ValueError, match="role must be one of system, user, assistant, tool"):
        ChatMessage("robot", "beep")
    assert ChatMessage("tool", "42", name="calc").as_dict() == {"role": "tool", "content": "42", "name": "calc"}
    assert ChatMessage("tool", "42").as_dict() == {"role": "tool", "content": "42"}


@pytest.mark.parametrize(
    ("source", "end"),
    [
        (CHATML_TEMPLATE, "<|im_end|>"),
        (LLAMA3_LIKE, "<|eot_id|>"),
        (ZEPHYR_LIKE, "</s>"),
        (GEMMA_LIKE, "<end_of_turn>"),
        (PLAIN, ""),  # nothing after the content but a newline
        ("{{ raise_exception('a system turn first') if messages[0].role != 'system' }}", ""),
    ],
)
def test_end_of_turn_is_what_follows_an_assistants_content(source, end):
    assert ChatTemplate(source, SPECIAL).end_of_turn() == end


def test_bundled_end_of_turn_and_stop_tokens_are_its_end_of_file():
    header = read_header(BUNDLED_MODEL)
    template = ChatTemplate.from_dir(BUNDLED_MODEL)
    assert template.end_of_turn() == EOS
    assert stop_token_ids(template, header.tokenizer) == frozenset({header.tokenizer.token_to_id(EOS)}) == {0}


def test_chatml_stops_at_the_end_of_turn_and_at_eos(chatml_dir, chatml_jinja_dir):
    for model_dir in (chatml_dir, chatml_jinja_dir):
        header = read_header(model_dir)  # the checkpoint loads: its vocabulary holds the added markers
        tokenizer = header.tokenizer
        assert header.args.vocab_size == tokenizer.get_vocab_size()
        assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == tokenizer.token_to_id("<|im_start|>")
        template = ChatTemplate.from_dir(model_dir)
        assert template.end_of_turn() == "<|im_end|>"
        ids = {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id(EOS)}
        assert None not in ids and stop_token_ids(template, tokenizer) == ids


def test_stop_tokens_leave_out_an_end_of_turn_that_is_not_one_added_token(chatml_dir):
    tokenizer = read_header(chatml_dir).tokenizer
    # Zephyr ends its turns with </s>, which this tokenizer does not have: only its eos token remains
    assert stop_token_ids(ChatTemplate(ZEPHYR_LIKE, {"eos_token": EOS}), tokenizer) == {tokenizer.token_to_id(EOS)}
    # "<|im_end|>" followed by text on the same line is no single token; with no eos there is nothing to stop at
    glued = CHATML_TEMPLATE.replace("'<|im_end|>' + '\\n'", "'<|im_end|>.'")
    assert ChatTemplate(glued).end_of_turn() == "<|im_end|>."
    assert stop_token_ids(ChatTemplate(glued), tokenizer) == frozenset()
