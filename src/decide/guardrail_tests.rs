//! Maintenance windows at their edges, across a DST change, deny over allow.

use chrono::TimeZone;

use super::*;
use crate::config::PoolConfig;

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

/// The `windows` of `[pools.p]` as the config parses them.
fn windows(text: &str) -> Vec<MaintenanceWindow> {
    let config = crate::config::test_config(&format!("[pools.p]\nwindows = {text}\n"));
    let pool: &PoolConfig = &config.pools[&PoolName::from("p")];
    pool.windows.clone()
}

fn opens(g: Option<Guard>) -> Option<DateTime<Utc>> {
    match g {
        Some(Guard::Window {
            deny: false, until, ..
        }) => until,
        other => panic!("outside an allow window: {other:?}"),
    }
}

#[test]
fn an_allow_window_opens_on_its_minute_and_closes_after_its_duration() {
    // 02:00 Berlin on weekdays for 3h; December is CET (UTC+1).
    let w =
        windows(r#"[{ allow = "0 2 * * Mon-Fri", duration = "3h", time_zone = "Europe/Berlin" }]"#);
    // Monday 2026-12-07.
    let open = utc(2026, 12, 7, 1, 0, 0);
    assert_eq!(
        opens(window_guard(&w, open - chrono::Duration::seconds(1))),
        Some(open)
    );
    assert_eq!(window_guard(&w, open), None, "open on its first second");
    assert_eq!(window_guard(&w, utc(2026, 12, 7, 3, 59, 59)), None);
    // Closed on the third hour's end; next opening Tuesday.
    assert_eq!(
        opens(window_guard(&w, utc(2026, 12, 7, 4, 0, 0))),
        Some(utc(2026, 12, 8, 1, 0, 0))
    );
    // Saturday: the next opening is Monday.
    let g = window_guard(&w, utc(2026, 12, 5, 1, 30, 0));
    assert_eq!(
        g.as_ref().map(|g| format!("{g}; {}", g.lifts())).as_deref(),
        Some("outside maintenance window; until a window opens Mon 2026-12-07 02:00 Europe/Berlin")
    );
    assert_eq!(opens(g), Some(open));
}

#[test]
fn a_window_follows_its_zone_across_a_dst_change() {
    // Berlin moves from CET to CEST on 2026-03-29: 02:00 local is 01:00 UTC
    // before and 00:00 UTC after.
    let w = windows(r#"[{ allow = "0 2 * * *", duration = "1h", time_zone = "Europe/Berlin" }]"#);
    assert_eq!(
        opens(window_guard(&w, utc(2026, 3, 28, 0, 30, 0))),
        Some(utc(2026, 3, 28, 1, 0, 0))
    );
    assert_eq!(window_guard(&w, utc(2026, 3, 28, 1, 30, 0)), None);
    assert_eq!(window_guard(&w, utc(2026, 3, 30, 0, 0, 0)), None);
    assert_eq!(window_guard(&w, utc(2026, 3, 30, 0, 59, 59)), None);
    assert_eq!(
        opens(window_guard(&w, utc(2026, 3, 30, 1, 0, 0))),
        Some(utc(2026, 3, 31, 0, 0, 0))
    );
    // And back on 2026-10-25: after it, 02:00 local is 01:00 UTC again.
    assert_eq!(
        opens(window_guard(&w, utc(2026, 10, 26, 0, 30, 0))),
        Some(utc(2026, 10, 26, 1, 0, 0))
    );
    assert_eq!(window_guard(&w, utc(2026, 10, 26, 1, 30, 0)), None);
}

#[test]
fn deny_wins_over_allow_and_no_windows_hold_nothing() {
    let w = windows(
        r#"[{ allow = "0 0 * * *", duration = "24h" }, { deny = "0 12 * * *", duration = "1h" }]"#,
    );
    assert_eq!(window_guard(&w, utc(2026, 12, 7, 11, 59, 59)), None);
    assert_eq!(
        window_guard(&w, utc(2026, 12, 7, 12, 0, 0)),
        Some(Guard::Window {
            deny: true,
            until: Some(utc(2026, 12, 7, 13, 0, 0)),
            time_zone: "UTC".into(),
        })
    );
    assert_eq!(window_guard(&w, utc(2026, 12, 7, 13, 0, 0)), None);
    // Only deny windows: open the rest of the time.
    let deny = windows(r#"[{ deny = "0 12 * * *", duration = "1h" }]"#);
    assert_eq!(window_guard(&deny, utc(2026, 12, 7, 9, 0, 0)), None);
    assert_eq!(window_guard(&[], utc(2026, 12, 7, 9, 0, 0)), None);
}
