"""The one exception hierarchy of rlrunbook.

Every error a user can cause is an ``RlrunbookError`` that also derives from the standard
exception it resembles, so ``except ValueError`` keeps working. Messages name the value,
the reason and the fix.
"""

from __future__ import annotations


class RlrunbookError(Exception):
    """Base class of every error rlrunbook raises on purpose."""


class ConfigError(RlrunbookError, ValueError):
    """An option, flag or configuration value is invalid or inconsistent."""


class InputError(RlrunbookError, ValueError):
    """Data handed to the library (tokens, datums, prompts, files) is malformed."""


class ModelNotFoundError(RlrunbookError, FileNotFoundError):
    """A model name resolves to nothing usable (no folder, no built-in, no cached download)."""


class ServiceUnreachableError(RlrunbookError, ConnectionError):
    """The hosted service (``TINKER_BACKEND=api``) did not answer within the stated timeout and attempts."""


class NoLearningSignalError(RlrunbookError, RuntimeError):
    """A batch for an advantage-based loss carries no non-zero advantage: training would be a no-op."""


class LogprobMismatchError(RlrunbookError, RuntimeError):
    """Sampler and trainer disagree on the logprobs of the same tokens beyond tolerance."""


class GenerationLeakError(RlrunbookError, RuntimeError):
    """Processed sampling scores differ from logits / temperature where no filter applies."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped a training run cleanly: its status is ``interrupted``.

    A ``KeyboardInterrupt`` (not an ``RlrunbookError``): code that catches interrupts keeps working.
    ``backend_stopped`` is False when the backend's running call had not ended yet (a second Ctrl-C).
    """

    def __init__(self, run_dir, last_checkpoint, backend_stopped: bool, signal_name: str = "SIGINT"):
        super().__init__(f"{signal_name}: run {run_dir} interrupted")
        self.run_dir, self.last_checkpoint = run_dir, last_checkpoint
        self.backend_stopped, self.signal_name = backend_stopped, signal_name
