"""User environments loaded by module path in the environment tests."""

from __future__ import annotations

from rlcli.environments.base import Environment, EnvironmentResponse


class EchoEnvironment(Environment):
    """Repeats the assistant's text back, `config["turns"]` times, then ends with reward 1."""

    def start(self, interaction_kwargs):
        return {"left": self.config.get("turns", 1)}

    def respond(self, state, assistant_text):
        state["left"] -= 1
        if state["left"] < 0:
            return EnvironmentResponse("", done=True, reward=1.0)
        return EnvironmentResponse(f"you said: {assistant_text}", done=False)


class NotAnEnvironment:
    pass
