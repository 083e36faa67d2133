"""Files, locks and the process heap: the bottom layer every package may use."""
