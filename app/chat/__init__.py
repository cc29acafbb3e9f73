"""The conversation: messages, the composer, streaming answers and how they are saved."""
