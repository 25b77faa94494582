"""Development tools runtime code never imports: the fake Blackwell device and the sm_100a / sm_103a compile checks."""
