mod bench;
mod cli;
mod harness;
mod restart;
