// The geofed web map: broker areas and sites, link status and rates, live events,
// "which brokers does this geofence reach" and the history inside a drawn shape.
// Everything it shows comes from this broker's HTTP bridge (relative URLs).
(function () {
  "use strict";

  var COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  var MAX_EVENTS = 200;
  var STATUS_EVERY_MS = 3000;

  var map = L.map("map", { worldCopyJump: true, minZoom: 1, zoomSnap: 0.25 });
  map.fitBounds([[-55, -170], [75, 180]]);
  var state = {
    map: map,
    broker: null,
    areas: {},      // broker id -> L.GeoJSON layer of its area
    sites: {},      // broker id -> [lat, lon]
    links: {},      // "a|b" -> L.Polyline between the two sites
    events: [],     // live events received (GeoJSON Features)
    route: null,    // last /api/route answer
    history: null,  // last history answer (FeatureCollection)
    ready: false,   // areas drawn
    live: false,    // the event stream is open
    errors: []
  };
  window.geofedMap = state;

  var eventLayer = L.layerGroup().addTo(map);
  state.eventLayer = eventLayer;
  var historyLayer = L.layerGroup().addTo(map);
  var drawnLayer = L.layerGroup().addTo(map);

  function text(el, value) { el.textContent = value; return el; }
  // Leaflet tooltips take HTML: anything from a publisher (topic, payload) is escaped.
  function esc(value) {
    return String(value).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;" }[c];
    });
  }
  function make(tag, cls) { var el = document.createElement(tag); if (cls) { el.className = cls; } return el; }
  function fail(where, err) {
    state.errors.push(where + ": " + err);
    // A warning, not console.error: a broker that is down is a state to show, not a page bug.
    console.warn("geofed map:", where, err);
  }
  // With `client_auth token` the page is opened as .../#access_token=<JWT>: the token
  // stays in the fragment (never sent with the page itself) and goes with every
  // request as the access_token parameter, the one way EventSource can carry it.
  var TOKEN = new URLSearchParams(window.location.hash.slice(1)).get("access_token");
  function authed(url) {
    if (!TOKEN) { return url; }
    return url + (url.indexOf("?") < 0 ? "?" : "&") + "access_token=" + encodeURIComponent(TOKEN);
  }
  function getJSON(url) {
    return fetch(authed(url)).then(function (r) {
      return r.json().then(function (body) {
        if (!r.ok) { throw new Error((body && body.message) || ("HTTP " + r.status)); }
        return body;
      });
    });
  }

  // -- the world outline (bundled, offline) and optional tiles --------------------
  // Rings crossing ±180 (Fiji, Eurasia at Chukotka) jump by 360° in longitude and,
  // drawn as they are, span the map. Unwrapped to continuous longitudes (and the
  // whole ring shifted back to the main map) they draw past ±180 instead. A ring
  // around a pole (Antarctica: an odd number of jumps) is left as it is.
  function unwrap(ring) {
    var jumps = 0, k;
    for (k = 1; k < ring.length; k++) {
      if (Math.abs(ring[k][0] - ring[k - 1][0]) > 180) { jumps++; }
    }
    if (jumps === 0 || jumps % 2 === 1) { return ring; }
    var prev = null, lo = Infinity, hi = -Infinity;
    var out = ring.map(function (p) {
      var x = p[0];
      if (prev !== null) {
        while (x - prev > 180) { x -= 360; }
        while (x - prev < -180) { x += 360; }
      }
      prev = x;
      lo = Math.min(lo, x);
      hi = Math.max(hi, x);
      return [x, p[1]];
    });
    var shift = -360 * Math.round((lo + hi) / 2 / 360);
    return out.map(function (p) { return [p[0] + shift, p[1]]; });
  }

  function unwrapped(geometry) {
    if (geometry.type === "Polygon") {
      return { type: "Polygon", coordinates: geometry.coordinates.map(unwrap) };
    }
    if (geometry.type === "MultiPolygon") {
      return { type: "MultiPolygon", coordinates: geometry.coordinates.map(function (poly) {
        return poly.map(unwrap);
      }) };
    }
    return geometry;
  }

  function drawWorld() {
    return getJSON("static/vendor/world-atlas/land-110m.json").then(function (topo) {
      var land = topojson.feature(topo, topo.objects.land);
      var parts = land.type === "FeatureCollection" ? land.features : [land];
      parts.forEach(function (f) {
        L.geoJSON(unwrapped(f.geometry), {
          interactive: false,
          // Fill only: outlines of a coarse world are noise under the areas.
          style: { stroke: false, fillColor: "#f3f1ea", fillOpacity: 1, className: "world" }
        }).addTo(map);
      });
    });
  }

  // -- the federation: areas and sites -----------------------------------------
  function drawFederation(info) {
    state.broker = info.broker;
    text(document.getElementById("broker"), "· broker " + info.broker);
    var features = info.federation.features;
    text(document.getElementById("summary"),
      features.length + " brokers, strategy " + info.strategy + "; events from anywhere (#) live below");
    if (info.tiles) {
      L.tileLayer(info.tiles, { maxZoom: 18, opacity: 0.7 }).addTo(map).bringToBack();
    }
    features.forEach(function (f, i) {
      var id = f.properties.id;
      var color = COLORS[i % COLORS.length];
      var layer = L.geoJSON(f, {
        style: {
          color: color, weight: id === info.broker ? 2.5 : 1.2, fillColor: color, fillOpacity: 0.12,
          className: "broker-area broker-area-" + id
        }
      }).bindTooltip(esc(id + (f.properties.name ? " (" + f.properties.name + ")" : "")), { sticky: true });
      layer.addTo(map);
      state.areas[id] = layer;
      var site = f.properties.site;
      if (site) {
        state.sites[id] = [site[1], site[0]];
        L.circleMarker([site[1], site[0]], {
          radius: 5, color: "#000", weight: 1, fillColor: color, fillOpacity: 1,
          className: "broker-site broker-site-" + id
        }).bindTooltip(esc(id), { permanent: true, direction: "right", className: "broker-label" }).addTo(map);
      }
    });
    state.ready = true;
    document.body.setAttribute("data-areas", String(features.length));
  }

  // -- links: status and rates from every broker's /api/status ---------------------
  function linkKey(a, b) { return a < b ? a + "|" + b : b + "|" + a; }

  function showStatus(answer) {
    var rows = document.querySelector("#links tbody");
    rows.textContent = "";
    var seen = {};
    Object.keys(answer.brokers).sort().forEach(function (id) {
      var s = answer.brokers[id];
      if (s.error) {
        var tr = make("tr");
        tr.appendChild(text(make("td"), id));
        tr.appendChild(text(make("td", "down"), "unreachable"));
        tr.appendChild(text(make("td"), "")); tr.appendChild(text(make("td"), ""));
        rows.appendChild(tr);
        return;
      }
      s.links.forEach(function (l) {
        var key = linkKey(id, l.peer);
        var row = make("tr");
        row.setAttribute("data-link", id + ">" + l.peer);
        row.appendChild(text(make("td"), id + " → " + l.peer));
        row.appendChild(text(make("td", l.connected ? "up" : "down"), l.connected ? "up" : "down"));
        row.appendChild(text(make("td"), l.sent_per_s.toFixed(1)));
        row.appendChild(text(make("td"), l.received_per_s.toFixed(1)));
        rows.appendChild(row);
        var a = state.sites[id], b = state.sites[l.peer];
        if (!a || !b) { return; }
        var line = state.links[key];
        if (!line) {
          line = state.links[key] = L.polyline([a, b], { weight: 1.5, className: "link", interactive: true }).addTo(map);
          line.bindTooltip("");
        }
        var prev = seen[key];
        var up = l.connected && (!prev || prev.up);
        var rate = l.sent_per_s + (prev ? prev.rate : 0);
        seen[key] = { up: up, rate: rate };
        line.setStyle({ color: up ? "#1a7f37" : "#c62828", dashArray: up ? null : "4 4",
                        weight: 1.5 + Math.min(6, Math.log1p(rate)) });
        line.setTooltipContent(esc(key.replace("|", " ↔ ")) + ": " + (up ? "up" : "down") + ", " + rate.toFixed(1) + " msg/s");
      });
    });
  }

  function pollStatus() {
    getJSON("api/federation/status").then(showStatus).catch(function (err) { fail("status", err); })
      .then(function () { setTimeout(pollStatus, STATUS_EVERY_MS); });
  }

  // -- live events (Server-Sent Events) --------------------------------------------------
  function eventItem(f, cls) {
    var p = f.properties;
    var li = make("li", cls);
    li.setAttribute("data-id", p.event_id);
    li.setAttribute("data-topic", p.topic);
    var when = new Date(p.published_at * 1000).toISOString().slice(11, 19);
    text(li, when + " " + p.topic + " = " + p.payload.slice(0, 80) + " (" + p.origin + ")");
    return li;
  }

  function addLive(f) {
    state.events.push(f);
    if (state.events.length > MAX_EVENTS) { state.events.shift(); }
    var c = f.geometry.coordinates;
    L.circleMarker([c[1], c[0]], { radius: 6, color: "#b00", fillColor: "#f44", fillOpacity: 0.8, className: "live-event" })
      .bindTooltip(esc(f.properties.topic + " = " + f.properties.payload.slice(0, 80))).addTo(eventLayer);
    var list = document.getElementById("events");
    list.insertBefore(eventItem(f, "live"), list.firstChild);
    while (list.children.length > MAX_EVENTS) { list.removeChild(list.lastChild); }
    while (eventLayer.getLayers().length > MAX_EVENTS) { eventLayer.removeLayer(eventLayer.getLayers()[0]); }
  }

  function openLive() {
    var label = document.getElementById("live-state");
    var source = new EventSource(authed("subscribe/%23"));
    source.addEventListener("ready", function () {
      state.live = true;
      label.setAttribute("data-state", "ready");
      text(label, "live");
    });
    source.addEventListener("event", function (e) { addLive(JSON.parse(e.data)); });
    source.onerror = function () {
      state.live = false;
      label.setAttribute("data-state", "reconnecting");
      text(label, "reconnecting");
    };
  }

  // -- drawing: which brokers a geofence reaches, history inside it ---------------------
  function wrapLon(x) { return ((x + 180) % 360 + 360) % 360 - 180; }

  function ringWkt(ring) {
    return "(" + ring.map(function (p) { return wrapLon(p[0]) + " " + p[1]; }).join(", ") + ")";
  }

  // The geofence text of a drawn layer: circle:LAT,LON,RADIUS_M or WKT (lon lat).
  function geofenceOf(layer) {
    if (layer instanceof L.Circle) {
      var c = layer.getLatLng();
      return "circle:" + c.lat + "," + wrapLon(c.lng) + "," + layer.getRadius();
    }
    var g = layer.toGeoJSON().geometry;
    if (g.type === "Polygon") { return "POLYGON(" + g.coordinates.map(ringWkt).join(", ") + ")"; }
    if (g.type === "MultiPolygon") {
      return "MULTIPOLYGON(" + g.coordinates.map(function (poly) {
        return "(" + poly.map(ringWkt).join(", ") + ")";
      }).join(", ") + ")";
    }
    throw new Error("draw a rectangle, polygon or circle");
  }

  function showRoute(answer) {
    state.route = answer;
    var box = document.getElementById("route-result");
    box.textContent = "";
    box.appendChild(text(make("p"), "Brokers whose area it meets (" + answer.brokers.length + "):"));
    var ul = make("ul");
    answer.brokers.forEach(function (id) {
      var li = text(make("li", "route-broker"), id);
      li.setAttribute("data-broker", id);
      ul.appendChild(li);
    });
    box.appendChild(ul);
    answer.strategies.forEach(function (s) {
      box.appendChild(text(make("div", "muted"), s.strategy + ": events to " + s.event_to.length +
        ", subscriptions to " + s.subscription_to.length + " of " + answer.flooding_messages));
    });
    Object.keys(state.areas).forEach(function (id) {
      state.areas[id].setStyle({ fillOpacity: answer.brokers.indexOf(id) >= 0 ? 0.35 : 0.05 });
    });
    box.setAttribute("data-state", "done");
    box.setAttribute("data-brokers", answer.brokers.join(","));
  }

  function isoParam(id) {
    var v = document.getElementById(id).value;
    return v ? new Date(v).toISOString() : null;
  }

  function showHistory(fc) {
    state.history = fc;
    historyLayer.clearLayers();
    var box = document.getElementById("history-result");
    box.textContent = "";
    box.appendChild(text(make("p"), fc.features.length + " events in the history inside it"));
    var list = make("ol");
    list.id = "history-list";
    fc.features.forEach(function (f) {
      var c = f.geometry.coordinates;
      L.circleMarker([c[1], c[0]], { radius: 5, color: "#035", fillColor: "#39f", fillOpacity: 0.8, className: "history-event" })
        .bindTooltip(esc(f.properties.topic + " = " + String(f.properties.payload).slice(0, 80))).addTo(historyLayer);
      list.appendChild(eventItem(f, "history"));
    });
    box.appendChild(list);
    box.setAttribute("data-state", "done");
    box.setAttribute("data-count", String(fc.features.length));
  }

  function askHistory(fence) {
    var q = "geometry=" + encodeURIComponent(fence);
    var from = isoParam("from"), to = isoParam("to");
    if (from) { q += "&from=" + encodeURIComponent(from); }
    if (to) { q += "&to=" + encodeURIComponent(to); }
    return getJSON("geopublish/%23?" + q).then(showHistory);
  }

  function mode() { return document.querySelector("input[name=mode]:checked").value; }

  // Called for every drawn shape (geoman's pm:create; tests fire it the same way).
  function onDrawn(e) {
    drawnLayer.clearLayers();
    drawnLayer.addLayer(e.layer);
    var fence;
    try { fence = geofenceOf(e.layer); } catch (err) { fail("draw", err); return; }
    var ask = mode() === "history" ? askHistory(fence)
      : getJSON("api/route?geofence=" + encodeURIComponent(fence)).then(showRoute);
    ask.catch(function (err) {
      var box = document.getElementById(mode() === "history" ? "history-result" : "route-result");
      box.setAttribute("data-state", "error");
      text(box, String(err.message || err));
    });
  }
  state.geofenceOf = geofenceOf;

  map.pm.addControls({
    position: "topleft", drawMarker: false, drawCircleMarker: false, drawPolyline: false,
    drawText: false, editMode: false, dragMode: false, cutPolygon: false, rotateMode: false,
    removalMode: false
  });
  map.on("pm:create", function (e) {
    map.removeLayer(e.layer);  // kept in drawnLayer instead
    onDrawn(e);
  });

  drawWorld().catch(function (err) { fail("world outline", err); })
    .then(function () { return getJSON("api/federation"); })
    .then(function (info) { drawFederation(info); openLive(); pollStatus(); })
    .catch(function (err) { fail("federation", err); });
})();
