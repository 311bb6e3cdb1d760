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
   */
  constructor(path, onEvents, { resume = true, onState = () => {} } = {}) {
    this.path = path;
    this.onEvents = onEvents;
    this.resume = resume;
    this.onState = onState;
    this.lastSeq = 0;
    this.delay = FIRST_DELAY_MS;
    this.stopped = false;
    this.socket = null;
    this.timer = null;
  }

  start() {
    this.stopped = false;
    this.connect();
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.socket) this.socket.close(1000);
    this.onState("closed");
  }

  url() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const query = this.resume ? `?after=${this.lastSeq}` : "";
    return `${scheme}//${location.host}${this.path}${query}`;
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
      const fresh = body.events.filter((e) => typeof e.seq !== "number" || e.seq > this.lastSeq);
      for (const e of fresh) if (typeof e.seq === "number") this.lastSeq = Math.max(this.lastSeq, e.seq);
      if (fresh.length) this.onEvents(fresh);
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
