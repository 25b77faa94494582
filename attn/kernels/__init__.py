"""Our kernels: the Triton/Gluon MLA kernels and their launch planner (triton_mla), the FA3 device
planner (fa3_plan), the paged family's block tables (block_tables); Triton or its stand-ins (triton_lang)."""
