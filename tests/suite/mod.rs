mod bench;
mod cli;
mod harness;
mod lineage;
mod restart;
