"""The back-off rule: which sequences draft each step, and how many drafts, from learned step costs and acceptance."""
