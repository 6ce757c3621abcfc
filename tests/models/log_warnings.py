"""A logging handler that keeps the warnings logged while it is attached (diffusers reports
missing or unexpected LoRA keys only as a warning)."""

import logging


class WarningMessages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
