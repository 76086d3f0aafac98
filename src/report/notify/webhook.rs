//! The webhook sink (`[[alerts.webhooks]]`): one [`Sink`] per configured
//! webhook, whatever its format.
//!
//! Owns, per webhook, the per-key state machine of the notifier's docs
//! (which incidents it was told of, at what severity and with which
//! machines; triggers, updates, repeats, resolves, and the action events
//! its format wants), its FIFO queue, its retries and dead letters, its
//! failing episodes, and its part of the state file. What differs between
//! formats (id, secret, events, body) is its `SinkKind` (`json`, `slack`,
//! `pagerduty`). It must never write the URL, a routing key, an HMAC
//! secret or a response body into a log, an error or the state file, and
//! never read the clock for alert decisions (`now` comes with the change).

use super::*;

/// One `[[alerts.webhooks]]`: the per-key state machine, its queue, its
/// dead letters (a [`Sink`] whose requests are its queued notifications).
pub(super) struct Webhook {
    pub(super) index: usize,
    /// What it sends and how (one file per kind).
    pub(super) kind: &'static dyn SinkKind,
    /// The name of the URL's variable: with the format, the sink's identity
    /// in the state file (the URL itself is a secret).
    pub(super) url_env: String,
    pub(super) min_severity: Severity,
    /// Zero disables repeats.
    pub(super) repeat_interval: Duration,
    pub(super) secrets: SinkSecrets,
    pub(super) state: Mutex<SinkState>,
    pub(super) wake: tokio::sync::Notify,
    /// Counts what happens to its notifications, where it happens.
    pub(super) counter: DeliveryCounter,
    /// `NotifierOptions::dead_letter_after` and `retry_interval`.
    pub(super) dead_letter_after: u32,
    pub(super) retry_interval: Duration,
}

#[derive(Default)]
pub(super) struct SinkState {
    /// Keys this sink has been sent (or has queued) a trigger for.
    pub(super) firing: BTreeMap<DedupKey, Tracked>,
    /// PagerDuty only: `action_failed` keys triggered and not yet resolved.
    pub(super) open_failures: HashSet<DedupKey>,
    pub(super) queue: VecDeque<Arc<Notification>>,
    /// Queued notifications per dedup key (repeats are not stacked behind them).
    pub(super) pending: HashMap<DedupKey, usize>,
    /// Refusals in the current overflow episode (`None`: not overflowing).
    pub(super) overflow: Option<u64>,
    /// Set aside, newest last.
    pub(super) dead_letters: VecDeque<DeadLetter>,
    /// `Some` while the sink dead-letters what it is sent.
    pub(super) failing: Option<Failing>,
    /// Failed attempts since the last success.
    pub(super) consecutive_failures: u32,
    pub(super) delivered: u64,
    pub(super) failed_attempts: u64,
    pub(super) dropped: u64,
    pub(super) dead_lettered: u64,
}

pub(super) struct Tracked {
    /// The latest version of the alert (for the resolve's summary and fields).
    pub(super) alert: Alert,
    /// The highest severity this sink was notified at since the last resolve.
    pub(super) notified_severity: Severity,
    /// The machines of the group as last notified (a change is an update).
    pub(super) members: BTreeSet<String>,
    pub(super) last_notified: DateTime<Utc>,
    /// The last trigger (not a repeat) was dead-lettered: the receiver may
    /// never have heard of the alert, so it is sent again once the sink recovers.
    pub(super) dead_lettered: bool,
}

/// Gives each configured sink the saved state of the same format and URL
/// variable (in order, when several share both); saved sinks no longer
/// configured are dropped with a WARN.
pub(super) fn restore_sinks(sinks: &[Arc<Webhook>], saved: Vec<SavedSink>) {
    let mut saved: Vec<Option<SavedSink>> = saved.into_iter().map(Some).collect();
    for sink in sinks {
        let slot = saved.iter_mut().find(|s| {
            s.as_ref()
                .is_some_and(|s| s.format == sink.kind.id() && s.url_env == sink.url_env)
        });
        let Some(s) = slot.and_then(Option::take) else {
            continue;
        };
        let mut st = lock(&sink.state);
        st.firing = s
            .firing
            .into_iter()
            .map(|(k, t)| {
                let t = Tracked {
                    alert: t.alert,
                    notified_severity: t.notified_severity,
                    members: t.members,
                    last_notified: t.last_notified,
                    dead_lettered: t.dead_lettered,
                };
                (k, t)
            })
            .collect();
        st.open_failures = s.open_failures.into_iter().collect();
        for n in s.queue {
            *st.pending.entry(n.dedup_key.clone()).or_default() += 1;
            st.queue.push_back(Arc::new(n));
        }
        st.dead_letters = s.dead_letters.into();
        st.failing = s.failing;
        st.consecutive_failures = s.consecutive_failures;
    }
    for s in saved.into_iter().flatten() {
        tracing::warn!(
            sink_format = %s.format,
            url_env = %s.url_env,
            queued = s.queue.len(),
            firing = s.firing.len(),
            dead_letters = s.dead_letters.len(),
            "alert state of a webhook that is no longer configured is dropped"
        );
    }
}

impl Webhook {
    pub(super) fn new(
        index: usize,
        hook: &WebhookConfig,
        kind: &'static dyn SinkKind,
        secrets: SinkSecrets,
        options: &NotifierOptions,
    ) -> Result<Webhook, NotifyError> {
        check_url(secrets.url.expose_secret()).map_err(|problem| NotifyError::InvalidUrl {
            index,
            url_env: hook.url_env.clone(),
            problem,
        })?;
        let missing = |what| NotifyError::MissingSecret {
            index,
            format: kind.id(),
            what,
        };
        if let Some(what) = kind.missing_secret(hook, &secrets) {
            return Err(missing(what));
        }
        // Unsigned bodies to a receiver configured to verify them would all be rejected.
        if hook.secret_env.is_some() && exposed(&secrets.hmac_secret).is_none_or(str::is_empty) {
            return Err(missing("HMAC secret"));
        }
        Ok(Webhook {
            index,
            kind,
            url_env: hook.url_env.clone(),
            min_severity: hook.min_severity,
            repeat_interval: hook.repeat_interval,
            secrets,
            state: Mutex::new(SinkState::default()),
            wake: tokio::sync::Notify::new(),
            counter: options.counter.clone(),
            dead_letter_after: options.dead_letter_after,
            retry_interval: options.retry_interval,
        })
    }

    /// Turns the alerts holding now and this sweep's events into this sink's
    /// notifications; returns how many were queued.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn plan(
        &self,
        st: &mut SinkState,
        current: &BTreeMap<DedupKey, Grouped>,
        frozen: &BTreeSet<DedupKey>,
        events: &[ActionEvent],
        links: &Links,
        now: DateTime<Utc>,
        capacity: usize,
    ) -> usize {
        let refused_before = st.dropped;
        // Resolves first: after a release, the old target's alerts clear
        // before the new target's fire.
        let mut queued = self.plan_resolves(st, current, frozen, now, capacity);
        queued += self.plan_alerts(st, current, frozen, now, capacity);
        queued += self.plan_events(st, events, links, capacity);
        if st.dropped == refused_before && st.queue.len() < capacity {
            self.end_overflow(st);
        }
        queued
    }

    /// The keys this sink is told nothing about now: those the freshness
    /// rule froze for every sink (`frozen`), and while this sink is
    /// failing, sinks failing (it would only dead-letter that too, or that
    /// they recovered).
    pub(super) fn frozen(&self, st: &SinkState, frozen: &BTreeSet<DedupKey>) -> BTreeSet<DedupKey> {
        let mut frozen = frozen.clone();
        if st.failing.is_some() {
            frozen.insert(sink_failing_key());
        }
        frozen
    }

    /// Resolves the tracked alerts that no longer hold (but the `frozen`
    /// ones); returns how many were queued.
    pub(super) fn plan_resolves(
        &self,
        st: &mut SinkState,
        current: &BTreeMap<DedupKey, Grouped>,
        frozen: &BTreeSet<DedupKey>,
        now: DateTime<Utc>,
        capacity: usize,
    ) -> usize {
        let mut queued = 0;
        let cleared: Vec<DedupKey> = st
            .firing
            .keys()
            .filter(|k| !current.contains_key(*k) && !frozen.contains(*k))
            .cloned()
            .collect();
        for key in cleared {
            let n = Notification::resolve(&st.firing[&key].alert, &key, now);
            if self.push(st, n, capacity) {
                st.firing.remove(&key);
                queued += 1;
            } // else: still tracked, so the next sweep offers the resolve again.
        }
        queued
    }

    /// Triggers the alerts that newly hold, and re-notifies the tracked ones
    /// that escalated, changed members or are due a repeat (but the `frozen`
    /// one); returns how many were queued.
    pub(super) fn plan_alerts(
        &self,
        st: &mut SinkState,
        current: &BTreeMap<DedupKey, Grouped>,
        frozen: &BTreeSet<DedupKey>,
        now: DateTime<Utc>,
        capacity: usize,
    ) -> usize {
        let mut queued = 0;
        let repeat = chrono::Duration::from_std(self.repeat_interval).ok();
        for (key, g) in current {
            let alert = &g.alert;
            if frozen.contains(key) {
                continue;
            }
            match st.firing.get_mut(key) {
                None if alert.severity < self.min_severity => {}
                None => {
                    if self.push(st, Notification::trigger(alert, key, false, now), capacity) {
                        queued += 1;
                        st.firing.insert(
                            key.clone(),
                            Tracked {
                                alert: alert.clone(),
                                notified_severity: alert.severity,
                                members: g.members.clone(),
                                last_notified: now,
                                dead_lettered: false,
                            },
                        );
                    }
                }
                Some(t) => {
                    // A state file from before grouping knows no members: adopt them.
                    if t.members.is_empty() {
                        t.members = g.members.clone();
                    }
                    queued += self.plan_tracked(st, key, g, repeat, now, capacity);
                }
            }
        }
        queued
    }

    /// One alert already tracked under `key`: notifies it again when it
    /// escalated, its members changed or a repeat is due, and keeps what was
    /// notified; returns how many were queued (0 or 1).
    pub(super) fn plan_tracked(
        &self,
        st: &mut SinkState,
        key: &DedupKey,
        g: &Grouped,
        repeat: Option<chrono::Duration>,
        now: DateTime<Utc>,
        capacity: usize,
    ) -> usize {
        let alert = &g.alert;
        let wanted = alert.severity >= self.min_severity;
        let quiet = !st.pending.contains_key(key);
        let t = st.firing.get(key).expect("checked above");
        let escalated = alert.severity > t.notified_severity && wanted;
        // Machines joined or converged: the incident is updated
        // (not while an earlier notification of it waits).
        let changed = t.members != g.members && wanted && quiet;
        let repeat_due =
            wanted && repeat.is_some_and(|r| !r.is_zero() && now - t.last_notified >= r) && quiet;
        let n = Notification {
            update: changed && !escalated,
            ..Notification::trigger(alert, key, !escalated && !changed, now)
        };
        let sent = (escalated || changed || repeat_due) && self.push(st, n, capacity);
        let t = st.firing.get_mut(key).expect("checked above");
        if sent {
            t.members = g.members.clone();
            t.last_notified = now;
            t.notified_severity = t.notified_severity.max(alert.severity);
            if escalated {
                t.dead_lettered = false;
            }
        }
        if alert.severity < t.notified_severity && !escalated {
            // Fell: remember, so that rising again re-notifies.
            t.notified_severity = alert.severity;
        }
        t.alert = alert.clone();
        usize::from(sent)
    }

    /// This sweep's action events, as the sink's kind wants them
    /// ([`SinkKind::on_event`]); returns how many were queued.
    pub(super) fn plan_events(
        &self,
        st: &mut SinkState,
        events: &[ActionEvent],
        links: &Links,
        capacity: usize,
    ) -> usize {
        let mut queued = 0;
        for e in events {
            let wanted = e.severity >= self.min_severity;
            let failure_key = event_key(EventKind::ActionFailed, e);
            let failure_open = st.open_failures.contains(&failure_key);
            match self.kind.on_event(e.kind, wanted, failure_open) {
                OnEvent::Skip => {}
                OnEvent::Send => {
                    queued += usize::from(self.push(st, Notification::event(e, links), capacity));
                }
                OnEvent::OpenFailure => {
                    if self.push(st, Notification::event(e, links), capacity) {
                        st.open_failures.insert(failure_key);
                        queued += 1;
                    }
                }
                OnEvent::ResolveFailure => {
                    let n = Notification {
                        status: Status::Resolved,
                        dedup_key: failure_key.clone(),
                        ..Notification::event(e, links)
                    };
                    if self.push(st, n, capacity) {
                        st.open_failures.remove(&failure_key);
                        queued += 1;
                    }
                }
            }
        }
        queued
    }

    /// Appends to the queue, or counts a refusal when it is full.
    pub(super) fn push(&self, st: &mut SinkState, n: Notification, capacity: usize) -> bool {
        if st.queue.len() >= capacity {
            st.dropped += 1;
            self.counter.sink(self.kind.id(), DeliveryResult::Dropped);
            let episode = st.overflow.get_or_insert(0);
            *episode += 1;
            if *episode == 1 {
                tracing::error!(
                    sink_format = self.kind.id(),
                    sink_index = self.index,
                    capacity,
                    event = n.event.as_str(),
                    "webhook queue full (receiver failing for long?): alert changes wait for a later sweep and one-shot events are dropped until it drains"
                );
            }
            return false;
        }
        *st.pending.entry(n.dedup_key.clone()).or_default() += 1;
        st.queue.push_back(Arc::new(n));
        true
    }

    /// Ends an overflow episode once a whole `plan` went by without a refusal.
    pub(super) fn end_overflow(&self, st: &mut SinkState) {
        if let Some(refused) = st.overflow.take() {
            tracing::warn!(
                sink_format = self.kind.id(),
                sink_index = self.index,
                refused,
                "webhook queue has room again"
            );
        }
    }

    pub(super) fn front(&self) -> Option<Arc<Notification>> {
        lock(&self.state).queue.front().cloned()
    }

    /// Removes `n` from the head of the queue (if it is still there).
    pub(super) fn pop(st: &mut SinkState, n: &Arc<Notification>) -> bool {
        if !st.queue.front().is_some_and(|f| Arc::ptr_eq(f, n)) {
            return false;
        }
        st.queue.pop_front();
        if let Some(count) = st.pending.get_mut(&n.dedup_key) {
            *count -= 1;
            if *count == 0 {
                st.pending.remove(&n.dedup_key);
            }
        }
        true
    }

    /// Removes the delivered head of the queue; the first success of a
    /// failing sink ends its episode.
    pub(super) fn delivered(&self, n: &Arc<Notification>) {
        let mut st = lock(&self.state);
        Webhook::pop(&mut st, n);
        st.delivered += 1;
        self.counter.sink(self.kind.id(), DeliveryResult::Delivered);
        st.consecutive_failures = 0;
        if st.failing.is_some() {
            self.recover(&mut st);
        }
    }

    /// A failed attempt of the head `n` at `now`: true when it was
    /// dead-lettered (the sink goes on with the next notification), false to
    /// retry it later.
    pub(super) fn failed(
        &self,
        n: &Arc<Notification>,
        error: &str,
        permanent: bool,
        limit: u32,
        now: DateTime<Utc>,
    ) -> bool {
        let mut st = lock(&self.state);
        st.failed_attempts += 1;
        self.counter.sink(self.kind.id(), DeliveryResult::Failed);
        st.consecutive_failures = st.consecutive_failures.saturating_add(1);
        let dead =
            permanent || st.failing.is_some() || (limit > 0 && st.consecutive_failures >= limit);
        if !dead {
            return false;
        }
        if !Webhook::pop(&mut st, n) {
            return true;
        }
        if st.failing.is_none() {
            tracing::error!(
                sink_format = self.kind.id(),
                sink_index = self.index,
                url_env = %self.url_env,
                error,
                consecutive_failures = st.consecutive_failures,
                "webhook is failing: its notifications are dead-lettered (one attempt each) until one is delivered; the other webhooks get alert_sink_failing"
            );
            st.failing = Some(Failing {
                since: now,
                reason: error.to_owned(),
            });
        }
        if n.status == Status::Firing
            && !n.repeat
            && let Some(t) = st.firing.get_mut(&n.dedup_key)
        {
            t.dead_lettered = true;
        }
        tracing::warn!(
            event = n.event.as_str(),
            status = n.status.as_str(),
            repeat = n.repeat,
            app = Notification::field(n.app.as_ref().map(AppName::as_str)),
            machine_id = Notification::field(n.machine_id.as_ref().map(MachineId::as_str)),
            commit = Notification::field(n.commit.as_ref().map(CommitId::as_str)),
            severity = %n.severity,
            sink_format = self.kind.id(),
            sink_index = self.index,
            error,
            "webhook notification dead-lettered"
        );
        st.dead_letters.push_back(DeadLetter {
            notification: (**n).clone(),
            error: error.to_owned(),
            at: now,
        });
        while st.dead_letters.len() > DEAD_LETTERS_KEPT {
            st.dead_letters.pop_front();
        }
        st.dead_lettered += 1;
        self.counter
            .sink(self.kind.id(), DeliveryResult::DeadLettered);
        true
    }

    /// Ends a failing episode: dead-lettered triggers of alerts still firing
    /// are forgotten (the next `update` triggers them again) and the last
    /// dead-lettered resolve of each alert no longer firing is queued again.
    pub(super) fn recover(&self, st: &mut SinkState) {
        let failing = st.failing.take();
        let mut resolves: BTreeMap<DedupKey, usize> = BTreeMap::new();
        for (i, d) in st.dead_letters.iter().enumerate() {
            let n = &d.notification;
            if n.status == Status::Resolved && !st.firing.contains_key(&n.dedup_key) {
                resolves.insert(n.dedup_key.clone(), i);
            }
        }
        let mut again: Vec<usize> = resolves.into_values().collect();
        again.sort_unstable();
        for i in again.iter().rev() {
            if let Some(d) = st.dead_letters.remove(*i) {
                *st.pending
                    .entry(d.notification.dedup_key.clone())
                    .or_default() += 1;
                // Behind what is queued: older than it, but about alerts that are not firing.
                st.queue.push_back(Arc::new(d.notification));
            }
        }
        let before = st.firing.len();
        st.firing.retain(|_, t| !t.dead_lettered);
        tracing::warn!(
            sink_format = self.kind.id(),
            sink_index = self.index,
            failing_since = %failing.map(|f| rfc3339(f.since)).unwrap_or_default(),
            dead_letters = st.dead_letters.len(),
            resolves_requeued = again.len(),
            triggers_resent = before - st.firing.len(),
            "webhook recovered: delivering again"
        );
    }

    /// This sink's part of the state file.
    pub(super) fn saved(&self) -> SavedSink {
        let st = lock(&self.state);
        SavedSink {
            format: self.kind.id().to_owned(),
            url_env: self.url_env.clone(),
            firing: st
                .firing
                .iter()
                .map(|(k, t)| {
                    let t = SavedTracked {
                        alert: t.alert.clone(),
                        notified_severity: t.notified_severity,
                        members: t.members.clone(),
                        last_notified: t.last_notified,
                        dead_lettered: t.dead_lettered,
                    };
                    (k.clone(), t)
                })
                .collect(),
            open_failures: st.open_failures.iter().cloned().collect(),
            queue: st.queue.iter().map(|n| (**n).clone()).collect(),
            dead_letters: st.dead_letters.iter().cloned().collect(),
            failing: st.failing.clone(),
            consecutive_failures: st.consecutive_failures,
        }
    }
}

impl Sink for Webhook {
    /// The head of its queue.
    type Request = Arc<Notification>;

    fn id(&self) -> &'static str {
        self.kind.id()
    }

    fn wake(&self) -> &tokio::sync::Notify {
        &self.wake
    }

    fn take(&self, change: &Change<'_>) -> bool {
        let Change::Alerts(c) = change else {
            return false;
        };
        let mut state = lock(&self.state);
        let frozen = self.frozen(&state, c.frozen);
        let queued = self.plan(
            &mut state, c.current, &frozen, c.events, c.links, c.now, c.capacity,
        );
        queued > 0
    }

    fn next(&self) -> Option<Arc<Notification>> {
        self.front()
    }

    fn request(
        &self,
        http: &reqwest::Client,
        n: &Arc<Notification>,
        unix_now: i64,
    ) -> reqwest::RequestBuilder {
        let rendered = self.kind.render(n, &self.secrets, unix_now);
        let mut request = http
            .post(self.secrets.url.expose_secret())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(rendered.body);
        for (name, value) in rendered.headers {
            request = request.header(name, value);
        }
        request
    }

    /// Delivered: off the queue. Failed: retried, or dead-lettered when
    /// the receiver refused it for good (a 4xx other than 408 and 429:
    /// 404/410 a webhook that is gone, 401/403 refused credentials,
    /// 400/413/422 a refused body) or the sink keeps failing.
    fn settle(&self, n: &Arc<Notification>, attempt: Attempt, now: DateTime<Utc>) -> Then {
        let (error, permanent) = match attempt {
            Attempt::Interrupted => return Then::Next,
            Attempt::Delivered { status } => {
                tracing::info!(
                    event = n.event.as_str(),
                    status = n.status.as_str(),
                    repeat = n.repeat,
                    app = Notification::field(n.app.as_ref().map(AppName::as_str)),
                    machine_id = Notification::field(n.machine_id.as_ref().map(MachineId::as_str)),
                    commit = Notification::field(n.commit.as_ref().map(CommitId::as_str)),
                    severity = %n.severity,
                    sink_format = self.kind.id(),
                    sink_index = self.index,
                    http_status = status,
                    "webhook delivered"
                );
                self.delivered(n);
                return Then::Next;
            }
            Attempt::Failed {
                status: Some(code), ..
            } if (300..400).contains(&code) => (
                format!("HTTP {code}: redirect refused (update the webhook URL)"),
                false,
            ),
            Attempt::Failed {
                error,
                status: Some(code),
            } => (
                error,
                (400..500).contains(&code) && !matches!(code, 408 | 429),
            ),
            Attempt::Failed {
                error,
                status: None,
            } => (error, false),
        };
        if self.failed(n, &error, permanent, self.dead_letter_after, now) {
            Then::Next
        } else {
            self.log_failure(n, &error);
            Then::Retry
        }
    }

    fn stopped(&self, kept: bool) {
        let left = lock(&self.state).queue.len();
        if left > 0 {
            let kept = if kept {
                "kept in the alert state file for the next start"
            } else {
                "lost (no alert state file)"
            };
            tracing::warn!(
                sink_format = self.kind.id(),
                sink_index = self.index,
                undelivered = left,
                "webhook notifications left undelivered at shutdown: {kept}"
            );
        }
    }
}

impl Webhook {
    pub(super) fn log_failure(&self, n: &Notification, error: &str) {
        let queued = lock(&self.state).queue.len();
        tracing::warn!(
            event = n.event.as_str(),
            status = n.status.as_str(),
            repeat = n.repeat,
            app = Notification::field(n.app.as_ref().map(AppName::as_str)),
            machine_id = Notification::field(n.machine_id.as_ref().map(MachineId::as_str)),
            commit = Notification::field(n.commit.as_ref().map(CommitId::as_str)),
            severity = %n.severity,
            sink_format = self.kind.id(),
            sink_index = self.index,
            error = %error,
            queued,
            retry_in = %humantime::format_duration(self.retry_interval),
            "webhook delivery failed; will retry"
        );
    }
}
