"""The dflash:: custom ops. Each op has one home here: torch reference semantics first, compiled forms later."""
