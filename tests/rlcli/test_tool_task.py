"""The tool quickstart's data: verl agent-loop rows read as they are, and SFT conversations."""

from __future__ import annotations

from rlcli.data import load_prompt_dataset, read_rows
from rlcli.data.sft_rows import SFTConversation, read_sft_rows
from rlcli.data.tool_task import write_tool_multiply_dataset
from rlcli.model.builder import train_tokenizer
from rlcli.rewards import default_compute_score
from rlcli.tools.calculator import CalculatorTool
from rlcli.tools.parsing import parse_hermes

TOOLS = [CalculatorTool.schema.to_openai()]


def test_rows_conversations_and_reward(tmp_path):
    paths = write_tool_multiply_dataset(str(tmp_path), num_train=400, num_val=50, num_sft=200)
    train = [row for _, row in read_rows(paths["train"])]
    val = [row for _, row in read_rows(paths["val"])]
    questions = {row["prompt"][0]["content"] for row in train}
    assert len(questions) == 400 and not questions & {r["prompt"][0]["content"] for r in val}
    row = train[0]
    assert row["agent_name"] == "tool_agent"
    assert row["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {}}}
    a, b = map(int, row["prompt"][0]["content"][len("What is ") : -1].split(" * "))
    assert 100 <= a <= 999 and 100 <= b <= 999
    assert row["reward_model"]["ground_truth"] == str(a * b)

    conversations = read_sft_rows(paths["sft_train"])
    assert len(conversations) == 200 and all(isinstance(c, SFTConversation) for c in conversations)
    with_tool = [c for c in conversations if len(c.messages) == 4]
    assert len(with_tool) == 200  # every trace calls the tool (tool_share=1 by default)
    trace = with_tool[0].messages
    [call] = parse_hermes(trace[1]["content"]).calls
    assert CalculatorTool().execute({}, call.arguments).text == trace[2]["content"]
    answer = trace[-1]["content"]
    x, y = map(int, call.arguments["expression"].split(" * "))
    truth = str(x * y)
    assert default_compute_score("tool_multiply", trace[1]["content"] + answer, truth)["acc"] == 1

    # The rows as rlcli reads them: the prompt rendered with the tools, messages and extra_info
    # kept whole.
    tokenizer = train_tokenizer([r["prompt"][0]["content"] for r in train], 300, "chatml")
    data = load_prompt_dataset(paths["train"], tokenizer, max_prompt_length=64, tools=TOOLS)
    item = data[0]
    assert item.prompt_messages == row["prompt"] and item.extra_info == row["extra_info"]
    assert item.prompt_text.startswith("<|im_start|>system\nTools: calculator(expression)\n")
    assert item.prompt_text.endswith("<|im_start|>assistant\n")


def test_tool_share_mixes_in_direct_answers(tmp_path):
    paths = write_tool_multiply_dataset(
        str(tmp_path), num_train=400, num_val=50, num_sft=200, tool_share=0.25
    )
    conversations = read_sft_rows(paths["sft_train"])
    with_tool = [c for c in conversations if len(c.messages) == 4]
    assert 20 < len(with_tool) < 80  # about a quarter
    direct = next(c for c in conversations if len(c.messages) == 2)
    a, b = map(int, direct.messages[0]["content"][len("What is ") : -1].split(" * "))
    assert direct.messages[1]["content"] == f"#### {a * b}"
