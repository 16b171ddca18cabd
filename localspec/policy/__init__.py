"""How many tokens to draft: acceptance model, verify-cost model, calibration."""
