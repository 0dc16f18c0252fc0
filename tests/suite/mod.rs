mod api;
mod bench;
mod cli;
mod cluster_cli;
mod config;
mod harness;
mod lineage;
mod restart;
