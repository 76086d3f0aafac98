//! Model benchmark: the rotation protocol's model check (#32), deeper than
//! the bounded run inside `cargo test` (tests/it/protocol_model).
//!
//! Run with `cargo bench --bench model` (optionally `-- DEPTH` and a state
//! budget `-- DEPTH STATES`, and scenario names to run only those, e.g.
//! `-- 80 checks_flap`). Prints, per scenario, states explored, unique
//! states, the maximum depth reached and seconds, beside the targets, and
//! each counterexample found (the shortest trace).

#[path = "../tests/it/protocol_model/mod.rs"]
#[allow(dead_code)]
mod protocol_model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut numbers = args.iter().filter_map(|a| a.parse::<usize>().ok());
    let depth = numbers.next().unwrap_or(80);
    let states = numbers.next().unwrap_or(2_000_000);
    // Names select scenarios; cargo passes `--bench` itself.
    let only: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-') && a.parse::<usize>().is_err())
        .map(String::as_str)
        .collect();
    let mut found = 0;
    for scenario in protocol_model::scenarios() {
        if !only.is_empty() && !only.contains(&scenario.name) {
            continue;
        }
        let r = protocol_model::run(&scenario, depth, states);
        println!(
            "{:<16} {:>10} states {:>10} unique  depth {:>3} (target {depth})  {:>7.1} s  (state target {states})  restart reached: {}",
            r.name, r.states, r.unique, r.depth, r.seconds, r.covered
        );
        for (property, trace) in &r.counterexamples {
            found += 1;
            println!("  counterexample of \"{property}\":\n{trace}");
        }
    }
    println!("{found} counterexample(s)");
}
