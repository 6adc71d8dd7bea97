"""What the integrations share (integrations/verl_reward.py, integrations/skyrl_reward.py): the critic 03 builds from
its flags, for a trainer other than 03."""

import critics
from policy import cli


def from_flags(critic: str, task: str = "demo", flags: list[str] | tuple = ()):
    """The critic 03 --critic CRITIC --task TASK FLAGS would build: the same flags, so the same critic."""
    return critics.make_critic(cli.parse_args(["--model", "unused", "--task", task, "--critic", critic, *flags]))
