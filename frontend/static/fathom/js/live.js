// A websocket that stays connected: it reconnects with exponential backoff and, where the
// server supports it, resumes after the last event it holds (`?after=SEQ`), so a dropped
// connection or a restarted web process costs no event and repeats none.

// Backoff after a lost connection: starts short so a blip is invisible, doubles up to a cap
// that keeps a long outage from turning into a tight reconnect loop. Jitter spreads the
// reconnects of many open tabs after a web restart.
const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 10000;

export class LiveEvents {
  /**
   * @param {string} path        e.g. "/ws/runs/7/"
   * @param {(events: object[]) => void} onEvents  called with fresh events, in seq order
   * @param {object} options
   *   resume: send `?after=SEQ` on (re)connect (the run socket supports it)
   *   onState: called with "connecting" | "live" | "reconnecting" | "closed"
   *   catchUp: `async (after) => events` reading the history over HTTP, polled every
   *     `catchUpMs`: where the socket relays only what its own process publishes (the
   *     embedded in-memory channel layer), events recorded by a worker still arrive.
   */
  constructor(path, onEvents, { resume = true, onState = () => {}, catchUp = null, catchUpMs = 3000 } = {}) {
    this.path = path;
    this.onEvents = onEvents;
    this.resume = resume;
    this.onState = onState;
    this.catchUp = catchUp;
    this.catchUpMs = catchUpMs;
    this.pollTimer = null;
    this.catching = null; // the catch-up request in flight, if any
    this.lastSeq = 0;
    this.delay = FIRST_DELAY_MS;
    this.stopped = false;
    this.socket = null;
    this.timer = null;
  }

  start() {
    this.stopped = false;
    this.connect();
    if (this.catchUp) this.pollTimer = setTimeout(() => this.poll(), this.catchUpMs);
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    clearTimeout(this.pollTimer);
    if (this.socket) this.socket.close(1000);
    this.onState("closed");
  }

  url() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const query = this.resume ? `?after=${this.lastSeq}` : "";
    return `${scheme}//${location.host}${this.path}${query}`;
  }

  /** Hands on events with a seq above the last one held, in seq order. */
  deliver(events) {
    const fresh = events.filter((e) => typeof e.seq !== "number" || e.seq > this.lastSeq);
    for (const e of fresh) if (typeof e.seq === "number") this.lastSeq = Math.max(this.lastSeq, e.seq);
    if (fresh.length) this.onEvents(fresh);
  }

  /**
   * Socket events, unless they skip past events not yet held: with `catchUp`, some events reach
   * this page only through the HTTP history, so a gap is filled from there (the socket's own
   * events are committed before they are sent, so the history holds them too).
   */
  fromSocket(events) {
    const fresh = events.filter((e) => typeof e.seq !== "number" || e.seq > this.lastSeq);
    if (this.catchUp && fresh.length && typeof fresh[0].seq === "number" && fresh[0].seq > this.lastSeq + 1) {
      this.catching ??= this.catchUp(this.lastSeq)
        .then((history) => this.deliver(history))
        .catch(() => {}) // the next poll tries again
        .finally(() => (this.catching = null));
      return;
    }
    this.deliver(fresh);
  }

  async poll() {
    try {
      if (document.visibilityState === "visible") this.deliver(await this.catchUp(this.lastSeq));
    } catch {
      // The socket's state already tells the reader the server is unreachable.
    } finally {
      if (!this.stopped) this.pollTimer = setTimeout(() => this.poll(), this.catchUpMs);
    }
  }

  connect() {
    this.onState(this.lastSeq ? "reconnecting" : "connecting");
    const socket = new WebSocket(this.url());
    this.socket = socket;
    socket.addEventListener("open", () => {
      this.delay = FIRST_DELAY_MS;
      this.onState("live");
    });
    socket.addEventListener("message", (message) => {
      let body;
      try {
        body = JSON.parse(message.data);
      } catch {
        return; // not ours to read
      }
      if (body.type !== "events" || !Array.isArray(body.events)) return;
      // A socket that cannot resume replays recent history on connect; keep only what is new.
      this.fromSocket(body.events);
    });
    socket.addEventListener("close", (event) => {
      if (this.socket !== socket) return;
      this.socket = null;
      // 4404: not found or not ours; retrying cannot help.
      if (this.stopped || event.code === 4404 || event.code === 4403) {
        this.onState("closed");
        return;
      }
      this.onState("reconnecting");
      const wait = this.delay * (0.75 + Math.random() * 0.5);
      this.delay = Math.min(this.delay * 2, MAX_DELAY_MS);
      this.timer = setTimeout(() => this.connect(), wait);
    });
    // An error is always followed by "close", which schedules the retry.
    socket.addEventListener("error", () => {});
  }
}
