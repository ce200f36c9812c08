"""What the forkserver of the ranks ``rlcli.commands.relaunch`` starts imports before it forks
them: the console quieted as ``rlcli.cli`` quiets it (the ranks inherit the warning filters), then
the training stack. Importing it is all it does."""

from rlcli.console import quiet_third_party_noise

quiet_third_party_noise()

import transformers.models.auto.modeling_auto  # noqa: E402, F401
import transformers.models.auto.tokenization_auto  # noqa: E402, F401

import rlcli.train.build  # noqa: E402, F401  (and with it the run's inputs, models, engines' base)
