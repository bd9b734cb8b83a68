"""The environment the pytest process started with, taken before any test code ran
(tests/conftest.py imports this module first): the base of every launch's environment
(helpers/launch.py), not os.environ as in-process tests left it. Importing
torchtitan_rl.generator sets vLLM's variables in this process; a launch carrying them would
differ from what a user's shell starts, and from the fork server's environment (so it would not
be forked)."""

import os

AT_START = dict(os.environ)
