"""OLMo 2 (``type: olmo2``) and OLMo 3 (``type: olmo3``) for levanter-core."""
