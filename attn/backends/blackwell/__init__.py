"""The Blackwell (SM100 family) backends: trtllm-gen, cute-dsl and tokenspeed-mla decode, and their device facts."""
